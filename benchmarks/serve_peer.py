"""``zoo serve`` on real-model shapes beside ``generate(compile=True)`` and, when built, llama.cpp's ``llama-server``.

    python -m benchmarks.serve_peer                          # SmolLM2-135M's shape, 1 thread: eager, compile, aot
    python -m benchmarks.serve_peer --shapes smollm2 qwen3 --threads 1 2
    python -m benchmarks.serve_peer --llama-server /path/to/llama-server   # + the peer on the same weights (F32 GGUF)
    LLAMA_SERVER=/path/to/llama-server python -m benchmarks.serve_peer     # the same (or llama-server on PATH)
    python -m benchmarks.serve_peer --kv-cache-dtypes auto float16   # each mode with float32 and float16 KV caches
    python -m benchmarks.serve_peer --weights plain prepacked        # each mode with plain and prepacked weights
    python -m benchmarks.serve_peer --peer-kv-cache-types f16 f32    # llama-server with each KV cache type
    python -m benchmarks.serve_peer --quick                  # a tiny model, few tokens: checks that the script runs

Per shape (``benchmarks.quantized.SHAPES``: random weights, seeded) and thread count, one run:

- **generate(compile=True)**: one request after another in this process, the reference of single-stream speed;
- **zoo serve (MODE)**: the server's application (``serving.openai_api.create_app``) in a child process with the
  engine in its own process (``zoo serve``'s default), driven by the ``openai`` client with token-id prompts and
  greedy decoding: requests one at a time, then ``--concurrency`` in flight at once. MODE is the engine's
  ``compile`` (eager, attention, single, compile, aot); for aot the packages are compiled in this process before
  the server starts (``prebuild``, its seconds printed), so the server measured runs them from its first request;
  with ``--kv-cache-dtypes``, each mode once per cache dtype (``Engine(kv_cache_dtype=...)``; llama-server's cache is
  float16 by default), and with ``--weights``, once per weight layout (``Engine(prepack_weights=...)``: ``zoo serve``
  ``prepacked`` is ``--prepack-weights``);
- **llama-server** (``find_llama_server``: ``--llama-server PATH``, else ``$LLAMA_SERVER``, else ``llama-server`` on
  ``PATH``; ``--no-peer`` skips it): ``-np`` ``--concurrency`` on the model written as an F32 GGUF file (a filler
  tokenizer of the model's vocabulary), its end-of-text token ignored (``ignore_eos``) as the zoo's model has none;
  once per ``--peer-kv-cache-types`` (its ``-ctk``/``-ctv``: ``f16``, its default, and ``f32``).

Reported: single-request tokens/s and its ratio to ``generate(compile=True)`` (goal >= 0.95), concurrent tokens/s
and its ratio to llama-server's (goal >= 1.0; the peer whose KV cache has the row's precision where both were
run, else the default float16 one) or, without the peer, to the server's own single-request tokens/s
(goal >= 5), the first use's seconds (the compiles), and the memory of the server's processes (their PSS summed,
``serving.memory``: shared library pages counted once; the RSS sum beside it) against the weights plus the KV cache
the concurrent requests hold (goal <= 1.3), also less the runtime two idle processes with the server's and the
engine's imports hold (``runtime_baseline``: the floor before any model). Whether every mode produced the same tokens
(per cache dtype).
The machine is shared and noisy: compare figures of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import inspect
import multiprocessing
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from benchmarks.quantized import FAMILY, SHAPES, filler_tokenizer
from blocks.prepacked_linear import prepack_linears
from models import DecoderLM, DecoderLMConfig
from serving.aot_steps import AheadOfTimeSteps
from serving.cache_size import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from serving.engine import Engine, kv_block_nbytes
from serving.engine_process import ModelSource
from serving.memory import process_memory, tree_memory

#: ``--weights``: the linear weights as stored, or prepacked (``Engine(prepack_weights=True)``).
WEIGHT_LAYOUTS = ("plain", "prepacked")
#: ``--peer-kv-cache-types``: llama-server's rows by its KV cache type.
PEER_NAMES = {"f16": "llama-server", "f32": "llama-server (kv f32)"}
MODES = {"eager": False, "attention": "attention", "compile": True, "single": "single", "aot": "aot"}
#: The modules each of ``zoo serve``'s processes imports: the runtime every server holds whatever its model.
RUNTIME = ("import torch, uvicorn, models, serving.openai_api", "import torch, models, serving.engine_worker")


def shaped_model(shape: str) -> DecoderLM:
    """A float32 ``DecoderLM`` of the shape's sizes with seeded random weights (``N(0, 0.02)`` matrices)."""
    options: dict = {"positional": {"base": 100000.0}}
    if FAMILY[shape] == "qwen3":
        options["attention"] = {"qk_norm": "rmsnorm", "qk_norm_eps": 1e-6}
    config = DecoderLMConfig(**SHAPES[shape], max_len=2048, dropout=0.0, positional="rotary", ffn="swiglu",
                             norm="rmsnorm", norm_eps=1e-6, sublayer="pre_norm", bias=False, tie_embeddings=True,
                             eos_token_id=None, options=options)
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return model


def runtime_baseline() -> int:
    """The proportional set (PSS) of two idle interpreters that imported what the server's and the engine's
    processes import, alive together (their shared libraries counted once): the memory floor of ``zoo serve``
    before any model."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    children = [subprocess.Popen([sys.executable, "-c", f"{code}; import sys; print(flush=True); sys.stdin.read()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) for code in RUNTIME]
    try:
        for child in children:
            child.stdout.readline()
        return sum(process_memory(child.pid)["pss"] for child in children)
    finally:
        for child in children:
            child.stdin.close()
            child.wait(60)


def _serve(folder: str, port: int, threads: int, concurrency: int, compile_mode: Any, kv_cache_dtype: str,
           prepack_weights: bool) -> None:
    """The child process: ``zoo serve``'s application, the engine in its own process loading the saved weights."""
    import uvicorn

    from serving.openai_api import create_app

    torch.set_num_threads(threads)  # the engine process takes as many
    model = DecoderLM.from_pretrained(folder, device="meta")  # this process holds the config only
    app = create_app(model, None, model_name="peer", engine_process=ModelSource(path=folder),
                     max_num_seqs=concurrency, compile=compile_mode, kv_cache_dtype=kv_cache_dtype,
                     prepack_weights=prepack_weights)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def find_llama_server(path: str | None = None) -> str | None:
    """The ``llama-server`` binary to run as the peer: ``path``, else ``$LLAMA_SERVER``, else ``llama-server`` on
    ``PATH``.

    Args:
        path: an explicit binary (``--llama-server``), or None.

    Returns:
        The binary's path, or None when none is given or found.

    Raises:
        FileNotFoundError: ``path`` (or ``$LLAMA_SERVER``) names no executable file.
    """
    given = path or os.environ.get("LLAMA_SERVER")
    if not given:
        return shutil.which("llama-server")
    if not (os.path.isfile(given) and os.access(given, os.X_OK)):
        raise FileNotFoundError(f"llama-server binary {given!r} is not an executable file; build it with "
                                "`cmake --build build --target llama-server` in llama.cpp (docs/engine-performance.md)")
    return given


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, alive: Any, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        if not alive():
            raise RuntimeError("the server exited before it was ready")
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not start within {seconds} s")


@contextlib.contextmanager
def zoo_server(folder: str, threads: int, concurrency: int, compile_mode: Any,
               kv_cache_dtype: str = "auto", prepack_weights: bool = False) -> Iterator[tuple[str, int]]:
    port = free_port()
    child = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(folder, port, threads, concurrency, compile_mode, kv_cache_dtype, prepack_weights))
    child.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", child.is_alive)
        yield f"http://127.0.0.1:{port}", child.pid
    finally:
        child.terminate()
        child.join(60)


@contextlib.contextmanager
def llama_server(binary: str, gguf: str, threads: int, concurrency: int, context: int,
                 kv_type: str = "f16") -> Iterator[tuple[str, int]]:
    port = free_port()
    process = subprocess.Popen([binary, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
                                "-np", str(concurrency), "-c", str(context * concurrency), "-ctk", kv_type,
                                "-ctv", kv_type],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", lambda: process.poll() is None)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(60)


async def drive(url: str, prompts: list[list[int]], gen_len: int, concurrent: bool,
                extra: dict[str, Any] | None = None, logprobs: int = 0) -> tuple[float, list[list[int]], int]:
    """Send every prompt (all at once, or one after another), ``extra`` added to each request's body; wall seconds,
    each request's token ids (from its log-probabilities: the ``tokens`` of the OpenAI completions shape, or the
    ``content`` entries' ids llama-server returns, which it leaves out where the text ends inside a UTF-8
    character) and the tokens generated (``usage.completion_tokens``)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600,
                                http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=256)))

    counts = []

    async def one(prompt: list[int]) -> list[int]:
        out = await client.completions.create(model="peer", prompt=prompt, max_tokens=gen_len, temperature=0,
                                              logprobs=logprobs, extra_body=extra)
        counts.append(out.usage.completion_tokens)
        choice = out.choices[0].logprobs
        content = (choice.model_extra or {}).get("content") if choice is not None else None
        if content:
            return [int(entry["id"]) for entry in content]
        tokens = choice.tokens if choice is not None and choice.tokens else []
        return [int(t) if str(t).lstrip("-").isdigit() else hash(t) for t in tokens]

    start = time.perf_counter()
    if concurrent:
        outs = list(await asyncio.gather(*(one(p) for p in prompts)))
    else:
        outs = [await one(p) for p in prompts]
    wall = time.perf_counter() - start
    await client.close()
    return wall, outs, sum(counts)


def measure_server(url: str, pid: int, prompts: list[list[int]], gen_len: int, singles: int,
                   extra: dict[str, Any] | None = None, logprobs: int = 0) -> dict[str, Any]:
    start = time.perf_counter()
    asyncio.run(drive(url, prompts[:1], gen_len, False, extra, logprobs))  # warm-up: the single-row graph
    asyncio.run(drive(url, prompts, gen_len, True, extra, logprobs))  # and the batched one
    first_use = time.perf_counter() - start
    wall, _, generated = asyncio.run(drive(url, prompts[:singles], gen_len, False, extra, logprobs))
    single = generated / wall
    wall, outs, generated = asyncio.run(drive(url, prompts, gen_len, True, extra, logprobs))
    time.sleep(1)  # the engine process hands back its burst's freed heap once idle
    memory = tree_memory(pid)
    return dict(single=single, concurrent=generated / wall, first_use=first_use, rss=memory["rss"],
                pss=memory["pss"], tokens=outs)


def prebuild(model: DecoderLM, kv_cache_dtype: str = "auto", prepack_weights: bool = False) -> float:
    """Compile ``Engine(compile="aot")``'s packages of ``model`` (the engine's block size; prepacked as the engine
    will, on a copy) before its server starts, so that the server's first use loads them (a server compiles them in
    the background, serving eagerly until then); the seconds it took (0 when they were on disk)."""
    start = time.perf_counter()
    block_size = inspect.signature(Engine).parameters["block_size"].default
    if prepack_weights:
        model = copy.deepcopy(model)
        prepack_linears(model)
    AheadOfTimeSteps(model, block_size, torch.float32, resolve_kv_cache_dtype(kv_cache_dtype)).wait()
    return time.perf_counter() - start


def generate_speed(model: DecoderLM, prompts: list[list[int]], gen_len: int, singles: int) -> float:
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=gen_len, compile=True)  # warm-up (compiles)
    start = time.perf_counter()
    for prompt in prompts[:singles]:
        model.generate(torch.tensor([prompt]), max_new_tokens=gen_len, compile=True)
    return singles * gen_len / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["smollm2"], choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--modes", nargs="+", default=["eager", "compile", "aot"], choices=sorted(MODES))
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                        help="run each mode with each KV cache dtype (default: the model's)")
    parser.add_argument("--weights", nargs="+", default=["plain"], choices=WEIGHT_LAYOUTS,
                        help="run each mode with each weight layout (default: plain; prepacked: Engine("
                             "prepack_weights=True), zoo serve --prepack-weights)")
    parser.add_argument("--peer-kv-cache-types", nargs="+", default=["f16"], choices=sorted(PEER_NAMES),
                        help="llama-server's KV cache types (its -ctk/-ctv), one server each (default f16, its "
                             "own default); a zoo row is compared with the peer of its cache's precision where run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--singles", type=int, default=2, help="requests timed one at a time")
    parser.add_argument("--llama-server", default=None,
                        help="path of a llama-server binary (default: $LLAMA_SERVER, else llama-server on PATH)")
    parser.add_argument("--no-peer", action="store_true", help="do not run llama-server even if one is found")
    parser.add_argument("--quick", action="store_true", help="a tiny model, few tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.concurrency, args.prompt_len, args.gen_len, args.singles = ["tiny"], 4, 8, 8, 1
    peer = None if args.no_peer else find_llama_server(args.llama_server)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, fp32, a shared machine: one run; "
          f"peer: {peer or 'none'}")
    report = []
    baseline = runtime_baseline()
    for shape in args.shapes:
        model = shaped_model(shape)
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=generator).tolist()
                   for _ in range(args.concurrency)]
        weights = sum(p.nbytes for p in model.parameters())
        positions = args.concurrency * (args.prompt_len + args.gen_len)
        kv = positions * kv_block_nbytes(model, 1)
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            gguf = None
            if peer:
                model.tokenizer = filler_tokenizer(vocab)
                gguf = str(model.save_gguf(Path(folder) / "model.gguf", "F32", model_type=FAMILY[shape]))
            for threads in args.threads:
                torch.set_num_threads(threads)
                rows = {"generate(compile=True)": {"single": generate_speed(model, prompts, args.gen_len,
                                                                            args.singles)}}
                for mode, kv_dtype, layout in [(m, d, w) for m in args.modes for d in args.kv_cache_dtypes
                                               for w in args.weights]:
                    name = f"zoo serve ({mode}" + ("" if kv_dtype == "auto" else f", kv {kv_dtype}") + \
                        ("" if layout == "plain" else f", {layout}") + ")"
                    prepack = layout == "prepacked"
                    built = prebuild(model, kv_dtype, prepack) if mode == "aot" else None
                    with zoo_server(folder, threads, args.concurrency, MODES[mode], kv_dtype,
                                    prepack) as (url, pid):
                        rows[name] = row = measure_server(url, pid, prompts, args.gen_len, args.singles)
                    row["kv"] = positions * kv_block_nbytes(model, 1, resolve_kv_cache_dtype(kv_dtype))
                    row["kv_dtype"] = kv_dtype
                    if built is not None:
                        row["compile_s"] = built
                        print(f"{name}: packages compiled in {built:.0f} s before the server started")
                    print(f"{name}: {row['single']:.2f} tok/s alone, {row['concurrent']:.2f} tok/s with "
                          f"{args.concurrency} in flight, PSS {row['pss'] / 2**20:.0f} MiB", flush=True)
                for kv_type in args.peer_kv_cache_types if gguf is not None else []:
                    name = PEER_NAMES[kv_type]
                    with llama_server(peer, gguf, threads, args.concurrency,
                                      args.prompt_len + args.gen_len, kv_type) as (url, pid):
                        rows[name] = row = measure_server(url, pid, prompts, args.gen_len, args.singles,
                                                          {"ignore_eos": True}, logprobs=1)
                    print(f"{name}: {row['single']:.2f} tok/s alone, {row['concurrent']:.2f} tok/s with "
                          f"{args.concurrency} in flight, PSS {row['pss'] / 2**20:.0f} MiB", flush=True)
                report.append(dict(shape=shape, threads=threads, rows=rows, weights=weights, kv=kv, runtime=baseline))
                print_table(report[-1])
    return report


def peer_of(rows: dict[str, dict[str, Any]], kv_dtype: str | None) -> dict[str, Any] | None:
    """The llama-server row a row is compared with: the one whose KV cache has the row's precision (``auto`` is the
    float32 model's own) where it was run, else llama-server with its default float16 cache, else None."""
    same = PEER_NAMES["f16" if kv_dtype == "float16" else "f32"]
    return rows.get(same) or rows.get(PEER_NAMES["f16"])


def print_table(entry: dict[str, Any]) -> None:
    rows = entry["rows"]
    reference = rows["generate(compile=True)"]["single"]
    peer = rows.get("llama-server")
    runtime = entry["runtime"]
    print(f"\n#### {entry['shape']}, {entry['threads']} thread(s): weights {entry['weights'] / 2**20:.0f} MiB, "
          f"KV of the concurrent requests {entry['kv'] / 2**20:.0f} MiB, runtime of two idle processes "
          f"{runtime / 2**20:.0f} MiB (PSS)\n")
    print("| system | 1 request tok/s | vs generate(compile) | concurrent tok/s | vs peer | vs own single | "
          "first use s | PSS MiB | RSS sum MiB | PSS vs weights+KV | (PSS - runtime) vs weights+KV |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "concurrent" not in r:
            print(f"| {name} | {r['single']:.2f} | 1.00x | | | | | | | | |")
            continue
        versus = peer_of(rows, r.get("kv_dtype")) if name.startswith("zoo") else r
        versus_peer = f"{r['concurrent'] / versus['concurrent']:.2f}x" if versus else "n/a"
        budget = entry["weights"] + r.get("kv", entry["kv"])  # the weights and the KV cache in its dtype
        beyond = f"{(r['pss'] - runtime) / budget:.2f}x" if name.startswith("zoo") else ""
        print(f"| {name} | {r['single']:.2f} | {r['single'] / reference:.2f}x | {r['concurrent']:.2f} | "
              f"{versus_peer} | {r['concurrent'] / r['single']:.2f}x | {r['first_use']:.0f} | "
              f"{r['pss'] / 2**20:.0f} | {r['rss'] / 2**20:.0f} | {r['pss'] / budget:.2f}x | {beyond} |")
    by_dtype: dict[str, list] = {}
    for name, r in rows.items():
        if name.startswith("zoo"):
            by_dtype.setdefault(r["kv_dtype"], []).append(r["tokens"])
    for kv_dtype, outs in by_dtype.items():
        print(f"\nsame tokens in every zoo mode (KV cache {kv_dtype}): {all(t == outs[0] for t in outs)}")
    zoo = next(iter(by_dtype.values()), [])
    if peer and zoo:
        pairs = [(a, b) for a, b in zip(peer["tokens"], zoo[0], strict=True) if a]  # ids llama-server reported
        same = sum(a == b for a, b in pairs)
        print(f"llama-server's tokens equal the zoo's in {same}/{len(pairs)} requests whose ids it reported (greedy "
              "on the same float32 weights; near-ties may break apart where the two sum in another order)")


if __name__ == "__main__":
    main()
