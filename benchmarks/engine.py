"""Continuous batching: ``serving.Engine`` against one-by-one ``generate(compile=True)`` and ``transformers``'
continuous batching, on requests of mixed lengths arriving over time.

    python -m benchmarks.engine                  # demo-sized and GPT-2-shaped models (figures: docs/serving.md)
    python -m benchmarks.engine --models demo    # one model
    python -m benchmarks.engine --quick          # tiny model, few requests: checks that the script runs
    python -m benchmarks.engine --models demo --compile   # adds Engine(compile=True) (one graph, compiled first)
    python -m benchmarks.engine --models demo --step-rows 40   # one decode step of 40 rows, per compile mode

The workload (seeded): ``--requests`` prompts with lengths uniform in ``--prompt-len`` and output lengths uniform in
``--output-len`` (random token ids, random fp32 weights, no EOS, so every request produces exactly its length),
arriving as a Poisson process of ``--rate`` requests/s. Each system serves the same requests at the same arrival
times (relative to its own start), greedily:

- **engine**: ``serving.Engine`` (paged cache, blocks of 16, token budget 512, up to 64 sequences per step); with
  ``--compile`` also ``Engine(compile=True)``, its one graph compiled in the warm-up;
- **(a) sequential**: each request in arrival order through ``DecoderLM.stream(compile=True)`` — a request starts
  when it has arrived and the previous one has finished;
- **(b) transformers**: ``continuous_batching_context_manager`` (the engine of ``generate_batch``) with ``sdpa``
  attention (paged under continuous batching), pages of 16, the same token budget and request limit, on the same
  weights exported with ``models.convert.export``; requests added at their arrival times, streamed.

Every system is warmed up first, so compiles are excluded; (a) streams ask for 512 positions and are closed after
the request's tokens, so every request uses one compiled graph (the bucket is capped at prompt + max_new_tokens).
Reported: output tokens/s (all output tokens ÷ time from the first arrival to the last token), time to first token
(from arrival) and inter-token latency (gaps between a request's successive tokens), p50/p99; the engine's peak
concurrency, the KV memory of its peak blocks in use, and the KV memory of a contiguous cache of (peak concurrency
× the longest request) for comparison. Greedy outputs of the engine are checked against (a) (they must be equal)
and counted against (b).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from models import DecoderLM
from serving import Engine

#: The positions every sequential ``stream`` asks for (prompt + new tokens), so that all share one cache bucket.
SEQUENTIAL_LIMIT = 512

SHAPES = {
    # examples/generate.py's demo model: preset "tiny" at d_model 128, 4 layers, a 2048-token BPE vocabulary.
    "demo": dict(vocab_size=2048, d_model=128, n_heads=4, d_ff=512, n_layers=4, max_len=512),
    "gpt2": dict(DecoderLM.presets["gpt2-small"]),
}


@dataclasses.dataclass
class Request:
    arrival: float
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass
class Result:
    name: str
    seconds: float
    tokens: dict[int, list[int]]
    ttft: list[float]
    itl: list[float]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens.values()) / self.seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.requests):
        n = rng.randint(*args.prompt_len)
        out.append(Request(t, [rng.randrange(vocab) for _ in range(n)], rng.randint(*args.output_len)))
        t += rng.expovariate(args.rate)
    return out


def timed(name: str, requests: list[Request], run: Callable[[Callable[[int, list[int]], None], float], Any]) -> Result:
    """Run a system; ``run(emit, start)`` calls ``emit(i, new_tokens)`` as request ``i`` gains tokens."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    stamps: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    gc.collect()  # what a warm-up's compiles left behind is not collected in the middle of the run
    start = time.perf_counter()

    def emit(i: int, new: list[int]) -> None:
        now = time.perf_counter() - start
        tokens[i] += new
        stamps[i] += [now] * len(new)

    extra = run(emit, start) or {}
    end = max(s[-1] for s in stamps.values())
    ttft = [stamps[i][0] - r.arrival for i, r in enumerate(requests)]
    itl = [b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False)]
    return Result(name, end - requests[0].arrival, tokens, ttft, itl, extra)


def wait_until(start: float, at: float) -> None:
    delay = start + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_engine(model: DecoderLM, requests: list[Request], args: argparse.Namespace, compile: bool | str = False,  # noqa: A002
               logprobs: int | None = None) -> Result:
    engine = Engine(model, block_size=16, max_num_seqs=getattr(args, "max_batch", 64), max_num_batched_tokens=512,
                    compile=compile)
    started = time.perf_counter()
    # Warm-up, compiling what ``compile`` asks for: a compiled step's graph of one row (or of rows of one block)
    # is apart from the graph of several (size-oblivious shapes still tell 1 from 2 or more).
    for prompts in ([r.prompt for r in requests[:4]], [requests[0].prompt], [[1, 2, 3]], [[1, 2, 3], [4, 5]]):
        engine.generate(prompts, max_tokens=4)
    if compile:
        print(f"(engine compile={compile!r}: warm-up with its compiles {time.perf_counter() - started:.0f} s)")

    def run(emit: Callable[[int, list[int]], None], start: float) -> dict[str, Any]:
        index: dict[str, int] = {}
        nxt, peak = 0, 0
        while nxt < len(requests) or engine.has_unfinished():
            now = time.perf_counter() - start
            while nxt < len(requests) and requests[nxt].arrival <= now:
                r = requests[nxt]
                index[engine.add_request(r.prompt, max_tokens=r.max_tokens, logprobs=logprobs)] = nxt
                nxt += 1
            if not engine.has_unfinished():
                wait_until(start, requests[nxt].arrival)
                continue
            for delta in engine.step():
                emit(index[delta.request_id], delta.token_ids)
                if delta.finish_reason is not None:
                    engine.pop_output(delta.request_id)
            peak = max(peak, len(engine.scheduler.running))
        per_block = engine.runner.block_nbytes()
        longest = max(len(r.prompt) + r.max_tokens for r in requests)
        return dict(peak_seqs=peak, kv_peak=engine.peak_blocks * per_block,
                    kv_contiguous=peak * longest * per_block / engine.allocator.block_size,
                    kv_pool=engine.runner.nbytes, preemptions=engine.scheduler.preemptions)

    return timed({False: "engine", True: "engine, compile=True"}.get(compile, f"engine, compile={compile!r}"),
                 requests, run)


def run_sequential(model: DecoderLM, requests: list[Request], args: argparse.Namespace) -> Result:
    # The compiled step's cache bucket is capped at prompt + max_new_tokens, so requests of different lengths would
    # each compile a graph: every stream asks for up to SEQUENTIAL_LIMIT positions (one bucket for all) and is
    # closed after the request's own number of tokens. The warm-up compiles that graph.
    def stream(r: Request) -> Any:
        ids = torch.tensor([r.prompt])
        return model.stream(ids, max_new_tokens=SEQUENTIAL_LIMIT - len(r.prompt), compile=True, eos_token_id=None)

    for r in requests[:2]:
        for _, _ in zip(range(4), stream(r), strict=False):
            pass

    def run(emit: Callable[[int, list[int]], None], start: float) -> None:
        for i, r in enumerate(requests):
            wait_until(start, r.arrival)
            tokens = stream(r)
            for _, token in zip(range(r.max_tokens), tokens, strict=False):
                emit(i, token.tolist())
            tokens.close()

    return timed("(a) sequential generate(compile=True)", requests, run)


def run_transformers(model: DecoderLM, requests: list[Request], args: argparse.Namespace) -> Result:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.utils import logging as hf_logging

    from models.convert.export import save_transformers

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as folder:
        save_transformers(model, folder)
        # sdpa: transformers switches to its paged form under continuous batching ("paged|sdpa" is deprecated).
        hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64 * -(-longest // 16), max_batch_tokens=512,
                                      max_requests_per_batch=64, allow_block_sharing=False)
    generation = GenerationConfig(max_new_tokens=max(r.max_tokens for r in requests), do_sample=False,
                                  eos_token_id=-1)

    def serve(requests: list[Request], emit: Callable[[int, list[int]], None], start: float) -> None:
        with hf.continuous_batching_context_manager(generation_config=generation, warmup=False,
                                                    continuous_batching_config=config) as manager:
            index, done, nxt = {}, 0, 0
            while done < len(requests):
                now = time.perf_counter() - start
                while nxt < len(requests) and requests[nxt].arrival <= now:
                    r = requests[nxt]
                    index[manager.add_request(r.prompt, max_new_tokens=r.max_tokens, streaming=True)] = (nxt, [0])
                    nxt += 1
                result = manager.get_result(timeout=0.001)
                if result is None:
                    continue
                i, seen = index[result.request_id]
                emit(i, result.generated_tokens[seen[0]:])
                seen[0] = len(result.generated_tokens)
                done += result.is_finished()

    warm = [dataclasses.replace(r, arrival=0.0) for r in requests[:4]]
    timed("warm-up", warm, lambda emit, start: serve(warm, emit, start))  # the same settings on a few requests
    return timed("(b) transformers continuous batching", requests, lambda emit, start: serve(requests, emit, start))


def time_steps(model: DecoderLM, args: argparse.Namespace, reps: int = 30) -> dict[str, float]:
    """Median ms of one decode-only step of ``args.step_rows`` rows (contexts uniform in the workload's prompt +
    output range, blocks of 16 taken in order), for each ``compile`` mode on its own runner; prints the table."""
    from serving.runner import PagedRunner

    rng = random.Random(args.seed)
    contexts = [rng.randint(args.prompt_len[0], args.prompt_len[1] + args.output_len[1])
                for _ in range(args.step_rows)]
    tables, first = [], 0
    for n in contexts:
        tables.append(list(range(first, first + -(-n // 16))))
        first += len(tables[-1])
    medians = {}
    for mode in (False, "attention", True):
        runner = PagedRunner(model, first, 16, compile=mode)
        for n, table in zip(contexts, tables, strict=True):  # fill each row's cache with a prefill
            runner.run([1] * (n - 1), [(n - 1, n - 1, table)])
        rows = [(1, n, table) for n, table in zip(contexts, tables, strict=True)]
        times = []
        for _ in range(reps + 5):  # the first 5 warm up (and compile)
            started = time.perf_counter()
            runner.run([3] * len(rows), rows)
            times.append(time.perf_counter() - started)
        medians[repr(mode)] = 1e3 * statistics.median(times[5:])
    print(f"\n#### one decode step of {args.step_rows} rows, contexts {min(contexts)}-{max(contexts)} "
          f"(median of {reps})\n\n| compile | ms | vs eager |\n|---|---|---|")
    for mode, ms in medians.items():
        print(f"| {mode} | {ms:.2f} | {medians['False'] / ms:.2f}x |")
    return medians


def main(argv: list[str] | None = None) -> list[tuple[str, list[Result]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["demo", "gpt2"], choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, nargs="+", default=None,
                        help="arrivals per second, one per model (default: 100 for demo, 10 for gpt2)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], choices=["sequential", "transformers"])
    parser.add_argument("--compile", action="store_true",
                        help="also the engine with compile=True (its graph compiled in the warm-up)")
    parser.add_argument("--compile-attention", action="store_true",
                        help='also the engine with compile="attention" (one graph, compiled in the warm-up)')
    parser.add_argument("--quick", action="store_true", help="a tiny model and 8 short requests")
    parser.add_argument("--step-rows", type=int, default=None,
                        help="instead of the workload: time one decode step of this many rows per compile mode")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.requests, args.prompt_len, args.output_len = ["demo"], 8, (4, 24), (2, 8)
        SHAPES["demo"] = dict(SHAPES["demo"], d_model=32, n_layers=1, n_heads=2, d_ff=64, vocab_size=256)
    rates = args.rate or [{"demo": 100.0, "gpt2": 10.0}[m] for m in args.models]
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, fp32")
    report = []
    for name, rate in zip(args.models, rates, strict=True):
        args.rate = rate
        torch.manual_seed(args.seed)
        model = DecoderLM(DecoderLM.config_class.from_dict(
            {**SHAPES[name], "dropout": 0.0, "attention_dropout": 0.0, "eos_token_id": None, "bos_token_id": None,
             "pad_token_id": None}
        )).eval()
        if args.step_rows:
            time_steps(model, args)
            continue
        requests = workload(args, model.config.vocab_size)
        results = [run_engine(model, requests, args)]
        if args.compile_attention:
            results.append(run_engine(model, requests, args, compile="attention"))
        if args.compile:
            results.append(run_engine(model, requests, args, compile=True))
        if "sequential" not in args.skip:
            results.append(run_sequential(model, requests, args))
        if "transformers" not in args.skip:
            results.append(run_transformers(model, requests, args))
        print_table(name, model, requests, args, results)
        report.append((name, results))
    return report


def print_table(name: str, model: DecoderLM, requests: list[Request], args: argparse.Namespace,
                results: list[Result]) -> None:
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    out_tokens = sum(r.max_tokens for r in requests)
    print(f"\n#### {name}: {n_params:.1f}M parameters, {len(requests)} requests at {args.rate:g}/s, prompts "
          f"{args.prompt_len[0]}-{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]} "
          f"({out_tokens} output tokens)\n")
    engine = results[0]
    print("| system | output tokens/s | engine speed-up | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in results:
        same = sum(r.tokens[i] == engine.tokens[i] for i in r.tokens)
        print(f"| {r.name} | {r.tokens_per_s:.0f} | {engine.tokens_per_s / r.tokens_per_s:.2f}x | "
              f"{percentile(r.ttft, 50):.2f} / {percentile(r.ttft, 99):.2f} | "
              f"{1e3 * statistics.median(r.itl):.0f} / {1e3 * percentile(r.itl, 99):.0f} | {same}/{len(r.tokens)} |")
    print()
    references = [r for r in results if not r.name.startswith("engine")]
    for r in results if references else []:
        if r.name.startswith("engine"):  # each engine against each reference: (a), (b)
            ratios = ", ".join(f"{r.tokens_per_s / ref.tokens_per_s:.2f}x {ref.name.split()[0]}" for ref in references)
            print(f"- {r.name}: {ratios}")
    e = engine.extra
    print(f"- engine: peak {e['peak_seqs']} concurrent requests, {e['preemptions']} preemptions; KV memory at peak "
          f"{e['kv_peak'] / 2**20:.1f} MiB (pool allocated {e['kv_pool'] / 2**20:.1f} MiB) vs a contiguous cache of "
          f"{e['peak_seqs']} x {max(len(r.prompt) + r.max_tokens for r in requests)} positions: "
          f"{e['kv_contiguous'] / 2**20:.1f} MiB ({e['kv_peak'] / max(e['kv_contiguous'], 1):.0%})")


if __name__ == "__main__":
    main()
