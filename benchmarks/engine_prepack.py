"""The engine in one process with its linear weights plain and prepacked (``Engine(prepack_weights=...)``),
alternated, one request at a time and many in flight.

    python -m benchmarks.engine_prepack                     # Qwen3-0.6B's shape, aot packages, float16 KV, 1 thread
    python -m benchmarks.engine_prepack --shape smollm2 --threads 2
    python -m benchmarks.engine_prepack --quick             # a tiny model, eager: checks that the script runs

Two copies of one model (``benchmarks.serve_peer.shaped_model``: random weights, seeded), one prepacked
(``blocks.prepacked_linear``), each under an engine in the same compile mode (``--mode``, default ``aot``: its
packages are compiled, or loaded from disk, before anything is timed) and cache dtype (``--kv-cache-dtype``,
default float16, llama.cpp's). Each round runs one request alone, then ``--concurrency`` at once, of ``--gen-len``
tokens after ``--prompt-len``-token prompts, on each engine in turn, and prints the tokens/s; then the prepacked
engine's throughput against the plain one's, and whether their tokens were the same. No server, no tokenizer. The
machine is shared and noisy: compare within one run.
"""

from __future__ import annotations

from typing import Any

from benchmarks.engine_kv_dtype import ab_args, ab_parser, random_prompts, ready, serve
from benchmarks.serve_peer import MODES, shaped_model
from serving import Engine
from serving.cache_size import KV_CACHE_DTYPES

LAYOUTS = ("plain", "prepacked")


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = ab_parser(__doc__)
    parser.add_argument("--kv-cache-dtype", default="float16", choices=list(KV_CACHE_DTYPES))
    args = ab_args(parser, argv)
    engines = {layout: ready(Engine(shaped_model(args.shape), compile=MODES[args.mode], max_num_seqs=args.concurrency,
                                    kv_cache_dtype=args.kv_cache_dtype, prepack_weights=layout == "prepacked"),
                             layout) for layout in LAYOUTS}
    packed = len(engines["prepacked"].prepacked)
    prompts = random_prompts(engines["plain"].model.config.vocab_size, args.concurrency, args.prompt_len)
    tokens = {layout: [out.token_ids for out in engine.generate(prompts, max_tokens=args.gen_len)]  # and warm-up
              for layout, engine in engines.items()}
    for engine in engines.values():
        serve(engine, prompts[:1], args.gen_len)
    print(f"{args.shape}, 1 and {args.concurrency} requests of {args.gen_len} tokens after {args.prompt_len}, "
          f"{args.threads} thread(s), compile {args.mode}, kv {args.kv_cache_dtype}, {packed} layers prepacked")
    speeds: dict[str, dict[int, list[float]]] = {layout: {1: [], args.concurrency: []} for layout in LAYOUTS}
    for _ in range(args.rounds):
        for n in (1, args.concurrency):
            for layout, engine in engines.items():
                wall, share = serve(engine, prompts[:n], args.gen_len)
                speeds[layout][n].append(n * args.gen_len / wall)
                print(f"{layout}, {n} in flight: {speeds[layout][n][-1]:.2f} tok/s, runner {share:.0%} of the wall",
                      flush=True)
    for n in (1, args.concurrency):
        ratios = [a / b for a, b in zip(speeds["prepacked"][n], speeds["plain"][n], strict=True)]
        print(f"prepacked vs plain, {n} in flight: {', '.join(f'{r:.2f}x' for r in ratios)}")
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["prepacked"], strict=True))
    print(f"same tokens: {same}/{len(prompts)} requests")
    return {layout: dict(tok_s=speeds[layout], tokens=tokens[layout], prepacked=packed if layout == "prepacked" else 0)
            for layout in LAYOUTS}


if __name__ == "__main__":
    main()
