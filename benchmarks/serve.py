"""The HTTP server's overhead: concurrent ``openai`` clients against ``zoo serve``'s application, beside the engine
driven in-process and the same requests one after another through ``generate``, on one workload.

    python -m benchmarks.serve                  # the demo-sized model, 64 requests (figures: docs/serving.md)
    python -m benchmarks.serve --quick          # a tiny model, few requests: checks that the script runs
    python -m benchmarks.serve --ipc            # the engine process's pipe: one message per step or per delta

The workload is ``benchmarks.engine``'s (seeded prompts and output lengths of random ids, Poisson arrivals, greedy,
no EOS: every request produces exactly its length). Systems:

- **server (engine process)**: ``zoo serve``'s application (``serving.openai_api.create_app``) under uvicorn in a
  child process (its own interpreter, so the client's event loop does not share a GIL with the server), on
  127.0.0.1, with the engine in its own process (``serving.engine_process.ProcessEngine``, which loads the saved
  model; the server process holds only its config); one ``openai.AsyncOpenAI`` client sends each request at its
  arrival time as a streamed ``/v1/completions`` call with token-id prompts, ``temperature=0`` and ``logprobs=0``
  (the chunks then carry the token ids: the model has no tokenizer). Three processes: client, server, engine;
- **server (in-process thread)**: the same with ``engine_process=False`` (``zoo serve --no-engine-process``): the
  engine stepped by a worker thread of the server process (``serving.AsyncEngine``);
- **engine in-process**: ``benchmarks.engine.run_engine`` (the same engine limits, stepped in this process, with
  ``logprobs=0`` as the server's requests have);
- **AsyncEngine in-process**: the same requests as asyncio streams over ``serving.AsyncEngine`` (the server's engine
  front, without HTTP);
- **sequential**: ``benchmarks.engine.run_sequential`` (``stream(compile=True)`` one request after another).

Reported: output tokens/s, TTFT and ITL p50/p99 of each, each server's throughput against the in-process engine
(its HTTP overhead), the peak number of requests in flight, whether the tokens are the same, and the cores each
process of a server row kept busy (client, server, engine: CPU seconds from ``/proc`` over the run's seconds).
``--rounds N`` runs every system N times, round after round, and reports each row from its median round.
``--quick`` (the smoke test's mode) runs the servers in a thread of this process instead of a child process and
leaves out the sequential row (its compile takes longer than the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing
import os
import pickle
import platform
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from benchmarks.engine import SHAPES, Request, Result, percentile, run_engine, run_sequential, timed, workload
from models import DecoderLM
from serving import AsyncEngine, Engine
from serving.engine_process import ModelSource, pack_delta, unpack_delta
from serving.requests import RequestDelta, TokenLogprob

ENGINE_LIMITS = dict(block_size=16, max_num_batched_tokens=512)


def server_app(folder: str, max_batch: int, engine_process: bool) -> Any:
    """``zoo serve``'s application of the saved model; with ``engine_process`` the engine process loads the weights
    and this process only the config."""
    from serving.openai_api import create_app

    if engine_process:
        model, source = DecoderLM.from_pretrained(folder, device="meta"), ModelSource(path=folder)
    else:
        model, source = DecoderLM.from_pretrained(folder).eval(), False
    return create_app(model, None, model_name="bench", engine_process=source, max_num_seqs=max_batch,
                      **ENGINE_LIMITS)


def serve(folder: str, port: int, threads: int, max_batch: int, engine_process: bool) -> None:
    """The child process: serve the saved model (until terminated; SIGTERM stops its engine process too)."""
    import uvicorn

    torch.set_num_threads(threads)  # the engine process takes as many
    uvicorn.run(server_app(folder, max_batch, engine_process), host="127.0.0.1", port=port, log_level="warning")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the server process and of its engine process (its child that is not ``multiprocessing``'s
    resource tracker), if it has one."""
    cpu = {"server": process_cpu(pid)}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
            cpu["engine"] = process_cpu(int(child))
    return cpu


@contextlib.contextmanager
def serving(folder: str, args: argparse.Namespace, engine_process: bool) -> Iterator[tuple[str, Any]]:
    """The server's URL while it runs, and a function giving its processes' CPU seconds: in a child process, or
    (``--quick``, no CPU figures) in a thread of this one."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    if args.quick:
        server = uvicorn.Server(uvicorn.Config(server_app(folder, args.max_batch, engine_process), host="127.0.0.1",
                                               port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        stop, alive = (lambda: setattr(server, "should_exit", True) or thread.join(60)), thread.is_alive
        cpu: Any = dict
    else:
        child = multiprocessing.get_context("spawn").Process(
            target=serve, args=(folder, port, args.threads, args.max_batch, engine_process))
        child.start()
        stop, alive = (lambda: child.terminate() or child.join(60)), child.is_alive
        cpu = functools.partial(server_cpu, child.pid)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        yield url, cpu
    finally:
        stop()


def run_server(folder: str, requests: list[Request], args: argparse.Namespace, engine_process: bool) -> Result:
    with serving(folder, args, engine_process) as (url, cpu):
        name = "server (engine process)" if engine_process else "server (in-process thread engine)"
        return asyncio.run(_drive(url, requests, name, cpu))


async def _drive(url: str, requests: list[Request], name: str, cpu: Any) -> Result:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=256)))

    async def one(r: Request, emit: Any) -> None:
        stream = await client.completions.create(model="bench", prompt=r.prompt, max_tokens=r.max_tokens,
                                                 temperature=0, logprobs=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                emit([int(t) for t in chunk.choices[0].logprobs.tokens])

    for r in requests[:4]:  # warm-up
        await one(Request(0.0, r.prompt, 4), lambda new: None)
    in_flight = {"now": 0, "peak": 0}

    async def scheduled(i: int, r: Request, start: float, emit: Any) -> None:
        await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
        in_flight["now"] += 1
        in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
        await one(r, lambda new: emit(i, new))
        in_flight["now"] -= 1

    cpu_before, client_before = cpu(), time.process_time()
    started = time.perf_counter()
    record: list[tuple[int, list[int], float]] = []
    await asyncio.gather(*(scheduled(i, r, started, lambda i, new: record.append((i, new, time.perf_counter())))
                           for i, r in enumerate(requests)))
    await client.close()
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    stamps: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    for i, new, at in record:
        tokens[i] += new
        stamps[i] += [at - started] * len(new)
    return Result(
        name, max(s[-1] for s in stamps.values()) - requests[0].arrival, tokens,
        ttft=[stamps[i][0] - r.arrival for i, r in enumerate(requests)],
        itl=[b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False)],
        extra={"peak_in_flight": in_flight["peak"], "cpu": {"client": time.process_time() - client_before,
                                                             **{k: v - cpu_before[k] for k, v in cpu().items()}}},
    )


def run_async_engine(model: DecoderLM, requests: list[Request], args: argparse.Namespace) -> Result:
    """The same requests as asyncio streams over ``AsyncEngine`` in this process: the server without HTTP."""
    engine = Engine(model, max_num_seqs=args.max_batch, **ENGINE_LIMITS)
    engine.generate([r.prompt for r in requests[:4]], max_tokens=4)  # warm-up

    def run(emit: Any, start: float) -> None:
        async def drive() -> None:
            front = AsyncEngine(engine)

            async def one(i: int, r: Request) -> None:
                await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
                request_id = await front.add_request(r.prompt, max_tokens=r.max_tokens, logprobs=0)
                async for delta in front.stream(request_id):
                    emit(i, delta.token_ids)

            await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
            await front.close()

        asyncio.run(drive())

    return timed("AsyncEngine in-process (no HTTP)", requests, run)


def _send_steps(conn: Any, steps: int, rows: int, per_delta: bool) -> None:
    """In a child process: ``steps`` steps of ``rows`` one-token deltas (with ``logprobs=0``), as the engine process
    sends them: one message per step, or (``per_delta``) one per delta."""
    for step in range(steps):
        token = step % 2048
        deltas = [pack_delta(RequestDelta(f"proc-{i}", 0, [token], "", None, [TokenLogprob(token, -1.5, {})]))
                  for i in range(rows)]
        if per_delta:
            for delta in deltas:
                conn.send(("delta", delta))
        else:
            conn.send(("step", [], deltas, None, {"running": rows}))
    conn.send(None)


def ipc_cost(rows: int, steps: int = 3000) -> None:
    """The server process's CPU time to receive and unpack one step's deltas, batched into one message or not."""
    spawn = multiprocessing.get_context("spawn")
    print(f"| engine process -> server, {rows} one-token deltas per step | bytes per step | server CPU per step (us) |")
    print("|---|---|---|")
    for per_delta in (False, True):
        receiver, sender = spawn.Pipe()
        child = spawn.Process(target=_send_steps, args=(sender, steps, rows, per_delta))
        child.start()
        sender.close()
        nbytes, cpu = 0, 0.0
        while True:
            started = time.process_time()
            raw = receiver.recv_bytes()
            message = pickle.loads(raw)
            if message is None:
                break
            for item in [message[1]] if per_delta else message[2]:
                unpack_delta(item)
            cpu += time.process_time() - started
            nbytes += len(raw)
        child.join()
        name = "one message per delta" if per_delta else "one message per step (what the engine process does)"
        print(f"| {name} | {nbytes / steps:.0f} | {1e6 * cpu / steps:.1f} |")


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo", choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=100.0, help="arrivals per second")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=16,
                        help="sequences the engine runs at once, in-process and in the server (the rest wait)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="run every system this many times, round after round")
    parser.add_argument("--ipc", action="store_true", help="measure the engine process's pipe only")
    args = parser.parse_args(argv)
    if args.ipc:
        ipc_cost(args.max_batch)
        return []
    shape = SHAPES[args.model]
    if args.quick:
        args.requests, args.prompt_len, args.output_len = 8, (4, 24), (2, 8)
        shape = dict(shape, d_model=32, n_layers=1, n_heads=2, d_ff=64, vocab_size=256)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = DecoderLM(DecoderLM.config_class.from_dict(
        {**shape, "dropout": 0.0, "attention_dropout": 0.0, "eos_token_id": None, "bos_token_id": None,
         "pad_token_id": None})).eval()
    requests = workload(args, model.config.vocab_size)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} thread(s) per process, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        systems = [lambda: run_server(folder, requests, args, True), lambda: run_server(folder, requests, args, False),
                   lambda: run_async_engine(model, requests, args),
                   # computing what the servers send: the chosen token's log-probability (logprobs=0)
                   lambda: run_engine(model, requests, args, logprobs=0)]
        if not args.quick:
            systems.append(lambda: run_sequential(model, requests, args))
        # Round after round, every system once: the load of a shared machine drifts, a round's figures are close in
        # time; each row is the round of its median ratio to the engine in-process of the same round.
        rounds = [[run() for run in systems] for _ in range(args.rounds)]
    ratios = [[r[i].tokens_per_s / r[3].tokens_per_s for r in rounds] for i in range(len(systems))]
    medians = [sorted(range(args.rounds), key=lambda k, i=i: ratios[i][k])[(args.rounds - 1) // 2]
               for i in range(len(systems))]
    results = [rounds[k][i] for i, k in enumerate(medians)]
    engine = rounds[0][3]
    peaks = " / ".join(str(r.extra["peak_in_flight"]) for r in results[:2])
    print(f"\n#### {args.model}: {len(requests)} requests at {args.rate:g}/s, prompts {args.prompt_len[0]}-"
          f"{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]}; at most {args.max_batch} "
          f"running at once, peak {peaks} requests in flight at the servers; {args.rounds} round(s)\n")
    print("| system | output tokens/s | vs engine in-process | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | same tokens |"
          + (" ratio in each round |" if args.rounds > 1 else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.rounds > 1 else ""))
    for i, r in enumerate(results):
        same = min(sum(run[i].tokens[j] == engine.tokens[j] for j in engine.tokens) for run in rounds)
        each = f" {', '.join(f'{x:.2f}' for x in ratios[i])} |" if args.rounds > 1 else ""
        print(f"| {r.name} | {r.tokens_per_s:.0f} | {ratios[i][medians[i]]:.2f}x | "
              f"{percentile(r.ttft, 50):.2f} / {percentile(r.ttft, 99):.2f} | "
              f"{1e3 * statistics.median(r.itl):.0f} / {1e3 * percentile(r.itl, 99):.0f} | {same}/{len(r.tokens)} |"
              + each)
    print()
    for i in (0, 1):
        print(f"{results[i].name}: HTTP overhead (1 - server / engine throughput, median round) "
              f"{1 - ratios[i][medians[i]]:.1%}")
    for r in results[:2]:
        cores = ", ".join(f"{k} {v / r.seconds:.2f}" for k, v in r.extra["cpu"].items())
        print(f"{r.name}: cores busy (CPU seconds / run seconds, median round): {cores}")
    return results


if __name__ == "__main__":
    main()
