"""The engine in one process with float32 and float16 KV caches (``Engine(kv_cache_dtype=...)``), alternated.

    python -m benchmarks.engine_kv_dtype                    # Qwen3-0.6B's shape, 16 requests, aot packages, 1 thread
    python -m benchmarks.engine_kv_dtype --shape smollm2 --threads 2
    python -m benchmarks.engine_kv_dtype --quick            # a tiny model, eager: checks that the script runs

Two engines share one model (``benchmarks.serve_peer.shaped_model``: random weights, seeded), one per cache dtype,
in the same compile mode (``--mode``, default ``aot``: its packages are compiled, or loaded from disk, before
anything is timed). Each round sends ``--concurrency`` requests of ``--gen-len`` tokens after ``--prompt-len``-token
prompts to each engine in turn and prints its tokens/s, the share of the wall its runner's steps took and the bytes
its pools hold; then the float16 cache's throughput against the float32 one's. No server, no tokenizer: what the
cache's dtype changes in the engine's own step. The machine is shared and noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.quantized import SHAPES
from benchmarks.serve_peer import MODES, shaped_model
from serving import Engine
from serving.cli_options import positive_int

DTYPES = ("auto", "float16")


def timed_runner(engine: Engine) -> None:
    """Make ``engine.runner.run`` add its seconds to ``engine.runner.spent``."""
    run, runner = engine.runner.run, engine.runner
    runner.spent = 0.0

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(*args)
        finally:
            runner.spent += time.perf_counter() - start

    runner.run = timed


def serve(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[float, float]:
    """Run every prompt to ``gen_len`` tokens at once; the wall seconds and the runner's share of them."""
    for prompt in prompts:
        engine.add_request(prompt, max_tokens=gen_len)
    engine.runner.spent = 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    return wall, engine.runner.spent / wall


def ab_parser(description: str) -> argparse.ArgumentParser:
    """The options of an in-process A/B run of two engines (this script's and ``benchmarks.engine_prepack``'s)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    parser.add_argument("--mode", default="aot", choices=sorted(MODES), help="the engines' compile mode")
    parser.add_argument("--concurrency", type=positive_int, default=16)
    parser.add_argument("--prompt-len", type=positive_int, default=64)
    parser.add_argument("--gen-len", type=positive_int, default=64)
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny model, eager, few tokens")
    return parser


def ab_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` (``--quick``: a tiny model, eager, few tokens) and set torch's threads."""
    args = parser.parse_args(argv)
    if args.quick:
        args.shape, args.mode, args.concurrency, args.prompt_len, args.gen_len, args.rounds = \
            "tiny", "eager", 4, 8, 8, 1
    torch.set_num_threads(args.threads)
    return args


def ready(engine: Engine, name: str) -> Engine:
    """Wait for ``engine``'s packages (raise if they failed) and time its runner (``timed_runner``)."""
    if engine.runner.aot is not None and not engine.runner.aot.wait():
        raise RuntimeError(f"the {name} engine's packages failed: {engine.runner.aot.failed}")
    timed_runner(engine)
    return engine


def random_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    """``count`` seeded random prompts of ``length`` ids (3 and up: no special tokens)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = ab_args(ab_parser(__doc__), argv)
    model = shaped_model(args.shape)
    engines = {dtype: ready(Engine(model, compile=MODES[args.mode], max_num_seqs=args.concurrency,
                                   kv_cache_dtype=dtype), dtype) for dtype in DTYPES}
    prompts = random_prompts(model.config.vocab_size, args.concurrency, args.prompt_len)
    for engine in engines.values():  # warm-up: the first steps of each shape
        serve(engine, prompts[:1], args.gen_len)
        serve(engine, prompts, args.gen_len)
    print(f"{args.shape}, {args.concurrency} requests of {args.gen_len} tokens after {args.prompt_len}, "
          f"{args.threads} thread(s), compile {args.mode}")
    speeds: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    for _ in range(args.rounds):
        for dtype, engine in engines.items():
            wall, share = serve(engine, prompts, args.gen_len)
            speeds[dtype].append(args.concurrency * args.gen_len / wall)
            print(f"kv {dtype}: {speeds[dtype][-1]:.2f} tok/s, runner {share:.0%} of the wall, pools "
                  f"{engine.runner.nbytes / 2**20:.1f} MiB", flush=True)
    ratios = [half / full for half, full in zip(speeds["float16"], speeds["auto"], strict=True)]
    print(f"float16 cache vs float32: {', '.join(f'{r:.2f}x' for r in ratios)}")
    return {dtype: dict(tok_s=speeds[dtype], pool_bytes=engine.runner.nbytes) for dtype, engine in engines.items()}


if __name__ == "__main__":
    main()
