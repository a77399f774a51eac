"""One request at a time through the engine, beside ``generate(compile=True)``, on SmolLM2-135M's shape.

    python -m benchmarks.engine_lone                 # 30 x 576 random weights, 48 new tokens, 2 rounds, one thread
    python -m benchmarks.engine_lone --quick         # 2 layers: checks that the script runs

Each round times ``generate(compile=True)``, ``Engine(compile=True)`` (its single-row graph, ``serving.single_row``)
and the eager ``Engine`` on the same prompt, one after another, and prints each engine's tokens/s against
``generate(compile=True)``'s; then whether the tokens are identical, the compiled engine's pool bytes and the
seconds of each first use (the compiles).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.quantized import SHAPES
from models import DecoderLM, DecoderLMConfig
from serving import Engine


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.rounds = 2, 4, 1
    torch.set_num_threads(args.threads)
    sizes = dict(SHAPES["smollm2"], n_layers=args.layers)
    config = DecoderLMConfig(**sizes, max_len=2048, dropout=0.0, positional="rotary", ffn="swiglu", norm="rmsnorm",
                             norm_eps=1e-6, sublayer="pre_norm", bias=False, tie_embeddings=True, eos_token_id=None,
                             options={"positional": {"base": 100000.0}})
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    prompt = torch.randint(3, sizes["vocab_size"], (1, args.prompt_len))
    n = args.tokens
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=n, compile=True)
    print(f"generate(compile=True) first use: {time.perf_counter() - start:.1f} s")
    compiled, eager = (Engine(model, max_num_seqs=16, max_model_len=2048, compile=mode) for mode in (True, False))
    start = time.perf_counter()
    compiled.generate([prompt[0].tolist()], max_tokens=n)
    print(f"Engine(compile=True) first use: {time.perf_counter() - start:.1f} s")
    rounds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        want = model.generate(prompt, max_new_tokens=n, compile=True)[0, args.prompt_len:].tolist()
        reference = n / (time.perf_counter() - start)
        speeds = {}
        for name, engine in (("compiled", compiled), ("eager", eager)):
            start = time.perf_counter()
            got = engine.generate([prompt[0].tolist()], max_tokens=n)[0].token_ids
            speeds[name] = n / (time.perf_counter() - start)
            speeds[f"{name} same tokens"] = float(got == want)
        rounds.append(dict(generate=reference, **speeds))
        print(f"generate(compile=True) {reference:.2f} tokens/s | Engine(compile=True) {speeds['compiled']:.2f} "
              f"({speeds['compiled'] / reference:.2f}x) | Engine() {speeds['eager']:.2f} "
              f"({speeds['eager'] / reference:.2f}x) | same tokens: "
              f"{bool(speeds['compiled same tokens'] and speeds['eager same tokens'])}")
    print(f"compiled engine's pools: {compiled.runner.nbytes / 2**20:.1f} MiB")
    return rounds


if __name__ == "__main__":
    main()
