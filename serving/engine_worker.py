"""The engine process of ``serving.engine_process.ProcessEngine``: it builds the model and its ``Engine``, then
applies the operations the server sends and answers each step with one message (deltas in the wire form of
``serving.requests.pack_delta``).

The loop: apply every operation that has arrived (``add``, ``abort``, ``lora``, ``call``, ``stop``), run one step
while some request is unfinished, send ``("step", acks, deltas, failed, stats)``. Idle, it blocks on the pipe, after
handing the heap its last burst freed back to the system (``serving.memory.release_freed_memory``): the resident set
then falls back to the weights, the KV pools and the runtime.
"""

from __future__ import annotations

import gc
import signal
from typing import Any

import torch

from .async_engine import abort_all, abort_deltas, call_on, engine_stats, forget_finished, lora_action
from .engine import Engine
from .memory import release_freed_memory, stop_compile_workers
from .model_source import ModelSource
from .requests import pack_delta


def run_engine_process(conn: Any, source: ModelSource, tokenizer: Any, limits: dict[str, Any], threads: int) -> None:
    """The engine process: build the model and the engine, then serve operations until told to stop or until the
    pipe closes (the server process has gone).

    Args:
        conn: the engine process's end of the pipe.
        source: how to build the model.
        tokenizer: the engine's tokenizer (None: the model's own).
        limits: the ``Engine`` arguments.
        threads: torch's thread count in this process.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process drains and then stops this one
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        model = source.build().eval()
        engine = Engine(model, tokenizer if tokenizer is not None else getattr(model, "tokenizer", None), **limits)
    except Exception as err:  # noqa: BLE001 - reported to the server, which fails with it
        conn.send(("load_failed", f"{type(err).__name__}: {err}"))
        return
    gc.collect()
    release_freed_memory()  # what loading freed (a dtype cast's or a converter's copies)
    conn.send(("ready", engine.context, engine_stats(engine)))
    try:
        _serve(conn, engine)
    except (EOFError, OSError):  # the server process has gone
        pass


def _serve(conn: Any, engine: Engine) -> None:
    busy = False
    while True:
        if busy and not engine.has_unfinished():  # a burst ended: its freed activations go back to the system
            release_freed_memory()
            stop_compile_workers()  # and the processes that compiled its first requests' graphs, if any
        busy = engine.has_unfinished()
        ops: list[tuple] = [] if busy else conn.recv()  # idle: wait for work
        while conn.poll():
            ops += conn.recv()
        acks, deltas, failed = [], [], None
        for op in ops:
            if op[0] == "stop":
                return
            if op[0] == "add":
                acks.append((op[1], _add(engine, *op[1:])))
            elif op[0] == "lora":
                error = lora_action(engine, *op[2:])
                acks.append((op[1], None if error is None else ("value", f"{error}")))
            elif op[0] == "call":
                acks.append((op[1], call_on(engine, op[2], *op[3])))
            else:
                deltas += abort_deltas(engine, op[1])
        if engine.has_unfinished():
            try:
                deltas += engine.step()
            except Exception as err:  # noqa: BLE001 - a failed step fails the requests it held, not the engine
                failed = (abort_all(engine), f"the engine step failed: {type(err).__name__}: {err}")
        forget_finished(engine, deltas)
        conn.send(("step", acks, [pack_delta(d) for d in deltas], failed, engine_stats(engine)))


def _add(engine: Engine, request_id: str, prompt: Any, sampling: Any, kwargs: dict[str, Any]) -> Any:
    """Queue a request; None when accepted, else why not (``("value" | "queue_full" | "error", message)``)."""
    try:
        spec = engine.make_request(prompt, sampling, **kwargs)
        if len(engine.scheduler.waiting) >= engine.max_waiting:
            return "queue_full", f"{len(engine.scheduler.waiting)} requests are waiting (max_waiting=" \
                                 f"{engine.max_waiting})"
        engine.enqueue(spec, request_id)
    except ValueError as err:
        return "value", str(err)
    except Exception as err:  # noqa: BLE001 - this request fails (500), the engine goes on
        return "error", f"{type(err).__name__}: {err}"
    return None

