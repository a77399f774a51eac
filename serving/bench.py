"""``zoo bench MODEL``: what the engine does on this machine, as ``llama-bench`` reports it — prompt processing and
single-stream generation tokens/s, the throughput of concurrent requests, the time to the first token, and memory.

    zoo bench ./my-model                                   # 128-token prompts, 64 new tokens, 16 concurrent requests
    zoo bench ./my-model --compile --threads 2 --concurrency 8 --prompt-len 512 --gen-len 128

The requests are seeded random token ids (no tokenizer needed), decoded greedily, in the engine of this process (no
HTTP: ``benchmarks/serve_peer.py`` measures the server). A request stops early at the model's EOS: tokens/s count
the tokens really produced. The first run of each kind is a warm-up (it compiles the graphs of ``--compile``); its
seconds are reported as ``first use``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from blocks.prepacked_linear import PrepackedLinear

from .cache_size import KV_CACHE_DTYPES
from .cli_options import add_prepack_option, prepack_choice
from .engine import Engine

_MIB = 2**20
#: ``--compile``'s choices and the ``Engine(compile=...)`` of each.
BENCH_COMPILE = {"none": False, "attention": "attention", "single": "single", "full": True, "aot": "aot"}


@dataclasses.dataclass
class BenchResult:
    """What ``measure`` found.

    Attributes:
        rows: each test's name, value and unit, in order.
    """

    rows: list[tuple[str, float, str]]

    def table(self, header: dict[str, str]) -> str:
        """A Markdown table: the ``header`` columns (model, threads, ...) repeated on every test row.

        Args:
            header: column name -> value, before the test's name, value and unit.

        Returns:
            The table's lines joined.
        """
        names = [*header, "test", "value", "unit"]
        lines = ["| " + " | ".join(names) + " |", "|" + "|".join("---" for _ in names) + "|"]
        for test, value, unit in self.rows:
            lines.append("| " + " | ".join([*header.values(), test, f"{value:.2f}", unit]) + " |")
        return "\n".join(lines)


def resident_memory() -> tuple[int, int]:
    """This process's resident set now and its high-water mark (``/proc/self/status``).

    Returns:
        ``(VmRSS, VmHWM)`` in bytes; 0 for what the system does not report.
    """
    fields = {"VmRSS:": 0, "VmHWM:": 0}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key = line.split(maxsplit=1)[0] if line.strip() else ""
                if key in fields:
                    fields[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return fields["VmRSS:"], fields["VmHWM:"]


def _run(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[float, list[float], list[float], int]:
    """All ``prompts`` at once: wall seconds, each request's seconds to its first token and to its last, tokens."""
    start = time.perf_counter()
    ids = [engine.add_request(p, max_tokens=gen_len) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            now = time.perf_counter() - start
            if delta.token_ids:
                first.setdefault(delta.request_id, now)
                last[delta.request_id] = now
    wall = time.perf_counter() - start
    tokens = sum(len(engine.pop_output(r).token_ids) for r in ids)
    return wall, [first[r] for r in ids], [last[r] for r in ids], tokens


def measure(engine: Engine, *, prompt_len: int = 128, gen_len: int = 64, concurrency: int = 16, repetitions: int = 3,
            seed: int = 0) -> BenchResult:
    """Benchmark ``engine`` on seeded random prompts of ``prompt_len`` ids, ``gen_len`` new tokens each.

    Args:
        engine: the engine (its model's weights in memory).
        prompt_len: prompt tokens per request (>= 1).
        gen_len: new tokens per request at most (>= 2).
        concurrency: requests in flight together in the concurrent test (>= 1).
        repetitions: requests run one at a time for the single-stream tests (>= 1).
        seed: the prompts' seed.

    Returns:
        ``ppN`` (prompt tokens/s, from the time to the first token of a lone request), ``tgN`` (a lone request's
        generation tokens/s after its first token), ``tgN xC`` (output tokens/s with ``concurrency`` requests), the
        times to the first token alone and under load (median), first-use seconds, and memory: weights, KV pools,
        resident set and its peak.

    Raises:
        ValueError: a size out of range, or a prompt and output longer than the engine's context.
    """
    for name, value, least in (("prompt_len", prompt_len, 1), ("gen_len", gen_len, 2),
                               ("concurrency", concurrency, 1), ("repetitions", repetitions, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if prompt_len + gen_len > engine.context:
        raise ValueError(f"prompt_len + gen_len = {prompt_len + gen_len} exceeds the engine's context of "
                         f"{engine.context} positions")
    vocab = engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    count = repetitions + concurrency + 2

    def prompt() -> list[int]:
        return torch.randint(min(3, vocab - 1), vocab, (prompt_len,), generator=generator).tolist()

    prompts = [prompt() for _ in range(count)]
    start = time.perf_counter()
    _run(engine, prompts[:1], gen_len)  # warm-up: one row (the single-row graph)
    _run(engine, prompts[1:3], gen_len)  # and several (the batched graph)
    first_use = time.perf_counter() - start
    pp, tg, ttft_alone = [], [], []
    for p in prompts[3:3 + repetitions]:
        _, first, last, tokens = _run(engine, [p], gen_len)
        pp.append(prompt_len / first[0])
        ttft_alone.append(first[0])
        if tokens > 1:
            tg.append((tokens - 1) / (last[0] - first[0]))
    wall, first, _, tokens = _run(engine, prompts[3 + repetitions:], gen_len)
    rss, peak = resident_memory()
    weights = sum(t.nbytes for t in (*engine.model.parameters(), *engine.model.buffers()))
    weights += sum(m.weight_nbytes for m in engine.model.modules() if isinstance(m, PrepackedLinear))
    rows = [
        (f"pp{prompt_len}", statistics.median(pp), "tokens/s"),
        (f"tg{gen_len}", statistics.median(tg) if tg else 0.0, "tokens/s"),
        (f"tg{gen_len} x{concurrency}", tokens / wall, "tokens/s"),
        ("ttft alone", 1000 * statistics.median(ttft_alone), "ms"),
        (f"ttft x{concurrency}", 1000 * statistics.median(first), "ms"),
        ("first use", first_use, "s"),
        ("weights", weights / _MIB, "MiB"),
        ("kv pools", engine.runner.nbytes / _MIB, "MiB"),
        ("resident", rss / _MIB, "MiB"),
        ("resident peak", peak / _MIB, "MiB"),
    ]
    return BenchResult(rows)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], None]]:
    """Add ``bench`` to the subparsers ``sub`` of the ``zoo`` command.

    Args:
        sub: what ``ArgumentParser.add_subparsers`` returned.

    Returns:
        ``{"bench": handler}``.
    """
    p = sub.add_parser("bench", help="measure the engine on this machine: prompt and generation tokens/s, "
                                     "concurrent throughput, time to first token, memory (as llama-bench)")
    p.add_argument("model")
    p.add_argument("--prompt-len", type=_positive, default=128, help="prompt tokens per request")
    p.add_argument("--gen-len", type=_positive, default=64, help="new tokens per request")
    p.add_argument("--concurrency", type=_positive, default=16, help="requests in flight in the concurrent test")
    p.add_argument("--repetitions", type=_positive, default=3, help="lone requests timed (median reported)")
    p.add_argument("--threads", type=_positive, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--compile", choices=list(BENCH_COMPILE), default="none",
                   help="Engine(compile=...): none (False), attention (\"attention\"), single (\"single\": the "
                        "single-row graph for a lone request), full (True), aot (\"aot\": compiled ahead of time in "
                        "a child process, waited for before measuring; its seconds are reported)")
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="the KV cache's dtype (Engine(kv_cache_dtype=...); default auto: the model's)")
    add_prepack_option(p)
    return {"bench": bench}


def bench(args: argparse.Namespace) -> None:
    """``zoo bench``: load the model, run ``measure`` and print its table.

    Args:
        args: the parsed ``zoo bench`` arguments.

    Raises:
        SystemExit: ``measure`` refused the sizes (one line naming the bad value).
    """
    from .loading import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    context = min(model.config.max_len, args.prompt_len + args.gen_len)
    params = sum(p.numel() for p in model.parameters())  # (before prepacking: its weights are no parameters)
    prepack = prepack_choice(args)
    start = time.perf_counter()
    engine = Engine(model, block_size=args.block_size, max_num_seqs=max(args.concurrency, 3),
                    max_model_len=max(context, 2), compile=BENCH_COMPILE[args.compile],
                    kv_cache_dtype=args.kv_cache_dtype, prepack_weights=prepack)
    aot = engine.runner.aot
    if aot is not None and not aot.wait():  # the steps stay eager (or compile in this process): said, then measured
        print(f"zoo bench: the ahead-of-time compiled steps are not used: {aot.failed.splitlines()[0]}",
              file=sys.stderr)
    compiled_s = time.perf_counter() - start
    try:
        result = measure(engine, prompt_len=args.prompt_len, gen_len=args.gen_len, concurrency=args.concurrency,
                         repetitions=args.repetitions)
    except ValueError as err:
        raise SystemExit(f"zoo bench: {err}") from None
    header = {"model": str(args.model), "params": f"{params / 1e6:.1f}M", "threads": str(torch.get_num_threads()),
              "compile": args.compile}
    if args.kv_cache_dtype != "auto":
        header["kv cache"] = args.kv_cache_dtype
    header["weights"] = f"{len(engine.prepacked)} prepacked" if engine.prepacked else "plain"
    if aot is not None:
        header["aot compile s"] = f"{compiled_s:.0f}"
    print(result.table(header))
