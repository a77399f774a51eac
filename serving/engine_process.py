"""``ProcessEngine``: the ``AsyncEngine`` front over an engine that runs in its own process (as vLLM v1's engine core).

Why: a server process that also steps the model shares one GIL between the event loop (HTTP, JSON, server-sent
events) and the engine's Python (scheduling, sampling, detokenizing); each waits for the other. Here the engine
process owns the model and its ``Engine`` and steps back to back while it has work; the server process only
translates HTTP and never competes with it for a GIL.

The wire: one ``multiprocessing`` pipe (a socketpair; objects pickled). The server sends lists of operations
(``add``, ``abort``, ``stop``): those made in one turn of its event loop go as one message. The engine process
applies every operation that has arrived, runs one step, and sends ONE message per step: the answers to the adds
(accepted, or the ``ValueError`` / ``QueueFullError`` text), every delta of every request as plain tuples, the ids
of requests a failed step aborted, and the statistics ``/metrics`` reads. The server reads the pipe from its event
loop (``loop.add_reader``): no thread, no polling.

The model is built in the engine process from a ``ModelSource``: a checkpoint (folder, Hub id or ``.gguf`` file,
loaded by ``models.from_pretrained`` with its options, then quantized or dequantized as asked: ``serving.loading``)
or a picklable factory (``ModelSource.from_model`` makes one from a model in memory: its class, config, quantized
layers and weights). The process is started with ``spawn`` (a fresh interpreter: forking a process that runs
torch's thread pools and an event loop is unsafe) and takes as many torch threads as the process that starts it has.

Failures: a step that raises fails the requests it held (``EngineStepError``), the engine process goes on. If the
engine process dies, every request in flight fails with ``EngineDeadError``, new ones are refused with it and
``alive`` turns False. The engine process ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a service manager
reaches the whole process group; the server drains first): it stops when told (``close``) or when its pipe closes
because the server process has gone, so it never outlives it.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
from collections.abc import Callable
from typing import Any

import torch

from .async_engine import DeltaStreams, EngineDeadError, EngineStepError
from .engine import QueueFullError
from .engine_worker import run_engine_process
from .model_source import ModelSource, rebuild_model
from .requests import pack_delta, unpack_delta

__all__ = ["ModelSource", "ProcessEngine", "pack_delta", "rebuild_model", "unpack_delta"]


class ProcessEngine(DeltaStreams):
    """Streams of per-request deltas over an ``Engine`` in its own process (the interface of ``AsyncEngine``).

    Args:
        source: how the engine process builds the model.
        tokenizer: the engine's tokenizer (decodes the outputs, stop strings); default the model's own.
        max_waiting: requests waiting in the engine at most (``QueueFullError`` beyond).
        engine_limits: the other ``Engine`` arguments (``max_num_seqs``, ``num_blocks``, ``block_size`` …).

    ``start()`` (on the event loop) waits until the model is loaded; errors loading it raise ``EngineDeadError``.

    Raises:
        ValueError: ``source`` is not a ``ModelSource``.
    """

    def __init__(self, source: ModelSource, tokenizer: Any = None, *, max_waiting: int = 1024,
                 **engine_limits: Any) -> None:
        super().__init__()
        if not isinstance(source, ModelSource):
            raise ValueError(f"source must be a ModelSource, got {type(source).__name__}")
        spawn = multiprocessing.get_context("spawn")
        self._conn, child_end = spawn.Pipe()
        limits = {**engine_limits, "max_waiting": max_waiting}
        self._process = spawn.Process(target=run_engine_process, name="zoo-engine",
                                      args=(child_end, source, tokenizer, limits, torch.get_num_threads()))
        self._process.start()
        child_end.close()  # the engine process holds the only other end: its exit closes the pipe
        self.pid = self._process.pid
        self.max_waiting = max_waiting
        self.context = 0  # the engine's context, once it is ready
        self.ready, self.alive, self.failure = False, True, None
        self._stats = {"running": 0, "waiting": 0, "blocks_total": 0, "blocks_used": 0, "prefix_hits": 0,
                       "compiling": 0}
        self._acks: dict[str, asyncio.Future[Any]] = {}
        self._outbox: list[tuple] = []
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future[None] | None = None
        atexit.register(self._stop_now)

    def stats(self) -> dict[str, int]:
        """The engine's statistics after its latest step (see ``serving.async_engine.engine_stats``).

        Returns:
            A copy of the counts.
        """
        return dict(self._stats)

    def listen(self) -> None:
        """Read the engine process's messages on the running event loop from now on (once)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._started = self._loop.create_future()
            self._loop.add_reader(self._conn.fileno(), self._readable)

    async def start(self) -> None:
        """``listen``, and return once the model is loaded.

        Raises:
            EngineDeadError: the engine process failed to load the model or exited.
        """
        self.listen()
        await asyncio.shield(self._started)

    async def add_request(self, prompt: Any, sampling: Any = None, *, max_tokens: Any = 16, stop: Any = None,
                          n: Any = 1, seed: Any = None, logprobs: Any = None, request_id: str | None = None,
                          constraint: Any = None, logit_bias: Any = None, adapter: str | None = None) -> str:
        """Queue a request (arguments as ``Engine.generate`` takes them for one prompt); return its id once the
        engine process has accepted it.

        Args:
            prompt: a string (needs the tokenizer) or a list of token ids.
            sampling: ``SamplingParams`` (default greedy).
            max_tokens: new tokens per sample at most.
            stop: stop strings and/or stop token ids.
            n: samples of the prompt.
            seed: the first sample's generator seed (None: drawn).
            logprobs: report log-probabilities of the new tokens and of this many most likely ones.
            request_id: the id to use (default: a fresh ``proc-N``).
            constraint: a ``Constraint`` the output must match, or None.
            logit_bias: ``{token_id: bias}`` added to the logits.
            adapter: the name of a loaded LoRA adapter, or None.

        Returns:
            The request's id; its deltas come from ``stream``.

        Raises:
            ValueError: bad arguments or an id in use.
            QueueFullError: the engine's waiting queue is at its bound.
            EngineDeadError: the engine process has exited.
        """
        await self.start()
        self._check_alive()
        request_id = f"proc-{next(self._ids)}" if request_id is None else str(request_id)
        queued = self._stats["waiting"] + len(self._acks)
        if queued >= self.max_waiting:
            raise QueueFullError(f"{queued} requests are waiting (max_waiting={self.max_waiting})")
        self.open_stream(request_id, n if isinstance(n, int) and n > 0 else 1)
        answer = self._acks[request_id] = self._loop.create_future()
        kwargs = dict(max_tokens=max_tokens, stop=stop, n=n, seed=seed, logprobs=logprobs, constraint=constraint,
                      logit_bias=logit_bias, adapter=adapter)
        self._send(("add", request_id, prompt, sampling, kwargs))
        try:
            refused = await answer
        except asyncio.CancelledError:  # the caller went away: the request must not run unwatched
            self.abort(request_id)
            self.drop_stream(request_id)
            raise
        except EngineDeadError:
            self.drop_stream(request_id)
            raise
        if refused is not None:
            self.drop_stream(request_id)
            kind, message = refused
            raise {"value": ValueError, "queue_full": QueueFullError}.get(kind, RuntimeError)(message)
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request: its stream ends with a delta whose ``finish_reason`` is ``"abort"`` per open sample.

        Args:
            request_id: the id ``add_request`` returned.
        """
        if self.alive and self._loop is not None:
            self._send(("abort", request_id))

    async def lora(self, action: str, name: str, path: Any = None) -> None:
        """Add or remove a LoRA adapter in the engine process, between two steps.

        Args:
            action: ``"add"`` (``Engine.add_lora``) or ``"remove"`` (``Engine.remove_lora``).
            name: the adapter's name.
            path: where to read it from (``"add"``).

        Raises:
            ValueError: see ``Engine.add_lora`` and ``remove_lora`` (a missing folder too).
            EngineDeadError: the engine process has exited.
        """
        await self.start()
        self._check_alive()
        key = f"lora-{next(self._ids)}"
        answer = self._acks[key] = self._loop.create_future()
        self._send(("lora", key, action, name, path))
        refused = await answer
        if refused is not None:
            raise ValueError(refused[1])

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` in the engine process, between two steps (``serving.async_engine.call_on``).

        Args:
            fn: a function picklable by reference (defined at a module's top level).
            *args: its other arguments (picklable).

        Returns:
            What it returned (picklable).

        Raises:
            ValueError: it raised a ``ValueError``; RuntimeError: another exception; EngineDeadError: no engine.
        """
        await self.start()
        self._check_alive()
        key = f"call-{next(self._ids)}"
        answer = self._acks[key] = self._loop.create_future()
        self._send(("call", key, fn, args))
        kind, value = await answer
        if kind != "ok":
            raise (ValueError if kind == "value" else RuntimeError)(value)
        return value

    async def close(self) -> None:
        """Stop the engine process (requests still in it are dropped; drain them first) and wait for it."""
        if self._conn.closed:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        if self.alive:
            self._flush()
        await asyncio.to_thread(self._stop_now)
        self._conn.close()
        if self.alive:
            self._dead("the engine was closed")

    # ------------------------------------------------------------------------------------------- the pipe
    def _send(self, op: tuple) -> None:
        self._outbox.append(op)
        if len(self._outbox) == 1:  # what this turn of the event loop sends goes as one message
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        ops, self._outbox = self._outbox, []
        if ops and self.alive:
            self._send_now(ops)

    def _send_now(self, ops: list[tuple]) -> None:
        try:
            self._conn.send(ops)
        except OSError:
            self._readable()  # the engine process is gone: read what it left, then its end

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())
            self._process.join(timeout=5)
            code = self._process.exitcode
            self._dead(f"the engine process exited (exit code {code})" + (f": {self.failure}" if self.failure else ""))

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, acks, deltas, failed, self._stats = message
            for request_id, refused in acks:
                answer = self._acks.pop(request_id, None)
                if answer is not None and not answer.done():
                    answer.set_result(refused)
            for item in deltas:
                self.deliver(unpack_delta(item))
            if failed is not None:
                self.fail(failed[0], EngineStepError(failed[1]))
        elif kind == "ready":
            _, self.context, self._stats = message
            self.ready = True
            self._started.set_result(None)
        elif kind == "load_failed":
            self.failure = f"building the model or the engine failed: {message[1]}"

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.failure or "the engine process has exited")

    def _dead(self, why: str) -> None:
        self.alive, self.ready, self.failure = False, False, why
        failure = EngineDeadError(why)
        self.fail(None, failure)
        for answer in [*self._acks.values(), self._started]:
            if answer is not None and not answer.done():
                answer.set_exception(failure)
        if self._started is not None and self._started.done() and self._started.exception() is not None:
            self._started.exception()  # retrieved: no "exception never retrieved" warning when nobody waits
        self._acks.clear()

    def _stop_now(self) -> None:
        """Stop the engine process now (also at interpreter exit): ask, wait a little, then kill."""
        if self._process.is_alive():
            try:
                self._conn.send([("stop",)])
            except OSError:
                pass
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        atexit.unregister(self._stop_now)

