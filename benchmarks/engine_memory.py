"""Where ``zoo serve``'s memory goes, phase by phase, in each of its two processes (SmolLM2-135M's shape).

    python -m benchmarks.engine_memory                     # eager engine
    python -m benchmarks.engine_memory --compile single    # the compiled single-row step (and "full": True)
    python -m benchmarks.engine_memory --compile aot       # the steps compiled ahead of time in a child process

Each process is a fresh interpreter doing what its side of ``zoo serve`` does, its memory read from
``/proc/self/smaps_rollup`` (``serving.memory``) after each phase (the first: torch and ``serving``'s engine
imported, which reading the figures needs):

- **server**: import the server's modules (``serving.openai_api``, uvicorn); load the checkpoint on the meta
  device (config and tokenizer only, as ``zoo serve`` does);
- **engine**: load the checkpoint (the weights: mapped from the
  safetensors file, file-backed); build the ``Engine``; a first request; ``--concurrency`` requests at once; the
  same again; the freed heap handed back (``release_freed_memory``, what the engine process does when it idles).

Columns: RSS, PSS, USS and the anonymous (heap, not file-backed) part, in MiB; the anonymous part split
(``serving.memory.heap_breakdown``) into Python's object arenas (pymalloc; in brackets the bytes of its live objects:
the rest is free space in arenas that still hold an object, resident) and glibc's ``malloc`` bytes in use; the
weights and the KV pools' bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serving.memory import heap_breakdown, process_memory, release_freed_memory, stop_compile_workers

COMPILE = {"eager": False, "attention": "attention", "single": "single", "full": True, "aot": "aot"}


def _phase(rows: list[dict[str, Any]], name: str, **extra: Any) -> None:
    rows.append({"phase": name, **process_memory(), **heap_breakdown(), **extra})


def server_side(folder: str) -> list[dict[str, Any]]:
    """The server process's phases (run in a fresh interpreter)."""
    rows: list[dict[str, Any]] = []
    _phase(rows, "torch and serving's engine imported")
    import uvicorn  # noqa: F401

    import models
    from serving import openai_api  # noqa: F401

    _phase(rows, "import the server's modules")
    models.from_pretrained(folder, device="meta")
    gc.collect()
    _phase(rows, "checkpoint loaded on the meta device")
    return rows


def engine_side(folder: str, compile_mode: Any, concurrency: int, prompt_len: int, gen_len: int
                ) -> list[dict[str, Any]]:
    """The engine process's phases (run in a fresh interpreter)."""
    import torch

    import models
    from serving import Engine

    rows: list[dict[str, Any]] = []
    _phase(rows, "torch and serving's engine imported")
    torch.set_num_threads(1)
    model = models.from_pretrained(folder).eval()
    gc.collect()
    weights = sum(p.nbytes for p in model.parameters())
    _phase(rows, "checkpoint loaded", weights=weights)
    engine = Engine(model, max_num_seqs=concurrency, compile=compile_mode)
    _phase(rows, "engine built")
    if engine.runner.aot is not None:  # "aot": the packages compiled in a child process (or on disk), then loaded
        start = time.perf_counter()
        engine.runner.aot.wait()
        _phase(rows, f"packages compiled and loaded ({time.perf_counter() - start:.0f} s)")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt_len,), generator=generator).tolist()
               for _ in range(concurrency)]
    for name, batch in (("first request", prompts[:1]), (f"{concurrency} requests at once", prompts),
                        (f"{concurrency} requests again", prompts)):
        start = time.perf_counter()
        engine.generate(batch, max_tokens=gen_len)
        _phase(rows, f"{name} ({time.perf_counter() - start:.0f} s)", pools=engine.runner.nbytes)
    release_freed_memory()
    stop_compile_workers()
    _phase(rows, "idle: freed heap handed back", pools=engine.runner.nbytes)
    return rows


def print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n#### {title}\n")
    print("| phase | RSS MiB | PSS MiB | USS MiB | anonymous MiB | Python arenas (objects) MiB | malloc in use MiB "
          "| notes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        notes = ", ".join(f"{k} {r[k] / 2**20:.0f} MiB" for k in ("weights", "pools") if k in r)
        print(f"| {r['phase']} | {r['rss'] / 2**20:.0f} | {r['pss'] / 2**20:.0f} | {r['uss'] / 2**20:.0f} | "
              f"{r['anonymous'] / 2**20:.0f} | {r['python_arenas'] / 2**20:.0f} ({r['python_objects'] / 2**20:.0f}) | "
              f"{r['malloc_in_use'] / 2**20:.0f} | {notes} |")


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2")
    parser.add_argument("--compile", choices=sorted(COMPILE), default="eager")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--side", choices=["server", "engine"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "server":
        print(json.dumps(server_side(args.folder)))
        return {}
    if args.side == "engine":
        print(json.dumps(engine_side(args.folder, COMPILE[args.compile], args.concurrency, args.prompt_len,
                                     args.gen_len)))
        return {}
    from benchmarks.serve_peer import shaped_model

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        shaped_model(args.shape).save_pretrained(folder)
        for side in ("server", "engine"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.engine_memory", "--side", side, "--folder", folder,
                                  "--compile", args.compile, "--concurrency", str(args.concurrency),
                                  "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)],
                                 capture_output=True, text=True, env=env, check=True)
            report[side] = json.loads(out.stdout.strip().splitlines()[-1])
            print_rows(f"{side} process ({args.shape}, compile={args.compile})", report[side])
    return report


if __name__ == "__main__":
    main()
