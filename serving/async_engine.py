"""``AsyncEngine``: the engine behind an asyncio server — add requests, stream their deltas, abort them.

One background task drives ``Engine.step`` in a worker thread (the event loop stays free while the model runs).
``add_request`` and ``abort`` never touch the engine from the event loop: they queue an operation that the worker
applies before its next step, so the engine is only ever used by one thread at a time. Arguments are checked in
``add_request`` itself, so a bad request raises ``ValueError`` to its caller at once.

``DeltaStreams`` is the part shared with ``serving.engine_process.ProcessEngine`` (the same front over an engine in
another process): one asyncio queue per request, fed with deltas, ending when every sample has finished.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from .engine import Engine, QueueFullError
from .requests import RequestDelta

_NOTHING = object()


def _joinable(first: RequestDelta, then: Any) -> bool:
    return isinstance(then, RequestDelta) and then.index == first.index and first.finish_reason is None


def _join(first: RequestDelta, then: RequestDelta) -> RequestDelta:
    logprobs = None if first.logprobs is None and then.logprobs is None else \
        [*(first.logprobs or []), *(then.logprobs or [])]
    return RequestDelta(first.request_id, first.index, first.token_ids + then.token_ids, first.text + then.text,
                        then.finish_reason, logprobs)


class EngineStepError(RuntimeError):
    """An engine step raised while this request was in the engine: the request was aborted."""


class EngineDeadError(EngineStepError):
    """The engine process exited: its requests in flight are lost and it takes no new ones."""


def engine_stats(engine: Engine) -> dict[str, int]:
    """What ``/metrics`` reads of an engine: sequences running and waiting, KV blocks in all and in use, prompt
    tokens taken from the prefix cache.

    Args:
        engine: the engine to read.

    Returns:
        ``running``, ``waiting``, ``blocks_total``, ``blocks_used`` and ``prefix_hits`` counts, and ``compiling``:
        1 while ``compile="aot"``'s packages are being compiled (the steps they will run are eager until then).
    """
    scheduler, allocator = engine.scheduler, engine.allocator
    aot = engine.runner.aot
    return {"running": len(scheduler.running), "waiting": len(scheduler.waiting), "blocks_total": allocator.n_blocks,
            "blocks_used": allocator.n_blocks - allocator.num_free, "prefix_hits": scheduler.prefix_hits,
            "compiling": int(aot is not None and aot.pending)}


class DeltaStreams:
    """Per-request asyncio queues of ``RequestDelta`` objects: ``stream(request_id)`` reads one; ``deliver``,
    ``fail`` and ``open_stream`` feed them (on the event loop's thread)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[RequestDelta | EngineStepError | None]] = {}
        self._open: dict[str, int] = {}  # request id -> samples not finished yet

    @property
    def open_requests(self) -> int:
        """Requests added and not finished yet."""
        return len(self._open)

    def open_stream(self, request_id: str, n: int) -> None:
        """Make the queue of a new request of ``n`` samples (before the engine can answer it).

        Args:
            request_id: the request's id.
            n: how many samples it has (its stream ends when all have finished).

        Raises:
            ValueError: ``request_id`` already has a queue.
        """
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is in use")
        self._queues[request_id] = asyncio.Queue()
        self._open[request_id] = n

    def drop_stream(self, request_id: str) -> None:
        """Forget a request the engine refused.

        Args:
            request_id: the request's id (unknown ids are ignored).
        """
        self._queues.pop(request_id, None)
        self._open.pop(request_id, None)

    async def stream(self, request_id: str) -> AsyncIterator[RequestDelta]:
        """The deltas of a request as its samples gain tokens, ending after every sample has finished.

        Args:
            request_id: the id ``open_stream`` was given.

        Yields:
            Its deltas in order; deltas of one sample that queued up meanwhile are joined into one.

        Raises:
            ValueError: no stream is open for ``request_id``.
            EngineStepError: an engine step failed while the request was in the engine (it was aborted).
        """
        queue = self._queues.get(request_id)
        if queue is None:
            raise ValueError(f"unknown request id {request_id!r}")
        held: Any = _NOTHING  # an item taken from the queue that did not join the delta before it
        try:
            while True:
                delta = await queue.get() if held is _NOTHING else held
                held = _NOTHING
                if delta is None:
                    return
                if isinstance(delta, EngineStepError):
                    raise delta
                # Deltas of the same sample that queued up while the reader was busy go out as one (fewer events
                # for a slow reader; the tokens, text and log-probabilities are the same, joined).
                while not queue.empty():
                    following = queue.get_nowait()
                    if not _joinable(delta, following):
                        held = following
                        break
                    delta = _join(delta, following)
                yield delta
        finally:
            self._queues.pop(request_id, None)

    def fail(self, request_ids: Any, failure: EngineStepError) -> None:
        """End the streams of ``request_ids`` (all open ones when None) with ``failure``.

        Args:
            request_ids: the requests to fail, or None for every open one.
            failure: the error their readers' ``stream`` raises.
        """
        for request_id in list(self._open) if request_ids is None else request_ids:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(failure)
            self._open.pop(request_id, None)

    def deliver(self, delta: RequestDelta) -> None:
        """Queue ``delta`` on its request's stream, ending the stream after its last sample finishes.

        Args:
            delta: a delta from the engine.
        """
        queue = self._queues.get(delta.request_id)
        if queue is not None:
            queue.put_nowait(delta)
        if delta.finish_reason is not None and delta.request_id in self._open:
            self._open[delta.request_id] -= 1
            if self._open[delta.request_id] == 0:
                del self._open[delta.request_id]
                if queue is not None:
                    queue.put_nowait(None)


class AsyncEngine(DeltaStreams):
    """Streams of per-request deltas over one ``Engine``, stepped in a worker thread of this process.

    Args:
        engine: the engine to drive (nothing else may call it meanwhile).
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self._ops: collections.deque[Callable[[], list[RequestDelta]]] = collections.deque()
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def context(self) -> int:
        """The engine's context: prompt + output tokens at most."""
        return self.engine.context

    #: Always ready and alive (the engine lives in this process); ``ProcessEngine`` reports its child's state.
    ready = alive = True
    failure: str | None = None

    def stats(self) -> dict[str, int]:
        """The engine's counts for ``/metrics`` (see ``engine_stats``).

        Returns:
            Sequences running and waiting, KV blocks in all and in use, prefix-cache hits.
        """
        return engine_stats(self.engine)

    def listen(self) -> None:
        """Nothing to listen to (the worker starts with the first request)."""

    async def start(self) -> None:
        """Nothing to start (the worker starts with the first request)."""

    async def add_request(self, prompt: Any, sampling: Any = None, *, max_tokens: Any = 16, stop: Any = None,
                          n: Any = 1, seed: Any = None, logprobs: Any = None, request_id: str | None = None,
                          constraint: Any = None, logit_bias: Any = None, adapter: str | None = None) -> str:
        """Queue a request (arguments as ``Engine.generate`` takes them for one prompt); return its id.

        Args:
            prompt: the prompt's token ids.
            sampling: the sampling parameters (None: the engine's defaults).
            max_tokens: new tokens per sample at most.
            stop: stop strings or token ids.
            n: samples to draw.
            seed: the sampling seed.
            logprobs: how many top log-probabilities to return per token (None: none).
            request_id: the id to use (None: a fresh one).
            constraint: a structured-output constraint on the tokens.
            logit_bias: token id -> bias added to its logit.
            adapter: the name of a loaded LoRA adapter to apply.

        Returns:
            The request's id, to pass to ``stream`` and ``abort``.

        Raises:
            ValueError: bad arguments (an adapter not loaded included) or an id in use.
            QueueFullError: the engine's waiting queue is at its bound.
        """
        spec = self.engine.make_request(prompt, sampling, max_tokens=max_tokens, stop=stop, n=n, seed=seed,
                                        logprobs=logprobs, constraint=constraint, logit_bias=logit_bias,
                                        adapter=adapter)
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        queued = len(self.engine.scheduler.waiting) + sum(1 for op in self._ops if getattr(op, "adds", False))
        if queued >= self.engine.max_waiting:
            raise QueueFullError(f"{queued} requests are waiting (max_waiting={self.engine.max_waiting})")
        self.open_stream(request_id, spec.n)

        def add() -> list[RequestDelta]:
            self.engine.enqueue(spec, request_id)
            return []

        add.adds = True  # type: ignore[attr-defined]
        self._submit(add)
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request: its stream ends with a delta whose ``finish_reason`` is ``"abort"`` per open sample.

        Args:
            request_id: the id ``add_request`` returned.
        """
        self._submit(lambda: abort_deltas(self.engine, request_id))

    async def lora(self, action: str, name: str, path: Any = None) -> None:
        """Add or remove a LoRA adapter between two steps of the worker: running requests are not disturbed.

        Args:
            action: ``"add"`` (``Engine.add_lora``) or ``"remove"`` (``Engine.remove_lora``).
            name: the adapter's name.
            path: where to read it from (``"add"``).

        Raises:
            ValueError: see ``Engine.add_lora`` and ``remove_lora``.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Exception | None] = loop.create_future()

        def apply() -> list[RequestDelta]:
            error = lora_action(self.engine, action, name, path)
            loop.call_soon_threadsafe(done.set_result, error)
            return []

        self._submit(apply)
        error = await done
        if error is not None:
            raise error

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` run by the worker between two steps (nothing else touches the engine meanwhile).

        Args:
            fn: the function.
            *args: its other arguments.

        Returns:
            What it returned.

        Raises:
            ValueError: it raised a ``ValueError``; RuntimeError: another exception (as ``call_on`` reports them).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[str, Any]] = loop.create_future()

        def apply() -> list[RequestDelta]:
            answer = call_on(self.engine, fn, *args)
            loop.call_soon_threadsafe(lambda: None if done.done() else done.set_result(answer))
            return []

        self._submit(apply)
        kind, value = await done
        if kind != "ok":
            raise (ValueError if kind == "value" else RuntimeError)(value)
        return value

    async def close(self) -> None:
        """Stop the background task (requests in flight are left as they are)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def _submit(self, op: Callable[[], list[RequestDelta]]) -> None:
        self._ops.append(op)
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    def _work(self) -> list[RequestDelta]:
        """In the worker thread: apply the queued operations, then one engine step."""
        deltas = []
        while self._ops:
            deltas += self._ops.popleft()()
        if self.engine.has_unfinished():
            deltas += self.engine.step()
        forget_finished(self.engine, deltas)
        return deltas

    async def _run(self) -> None:
        while True:
            if not self._ops and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                deltas = await asyncio.to_thread(self._work)
            except Exception as err:  # noqa: BLE001 - a failed step fails the requests it held, not the engine
                abort_all(self.engine)
                failure = EngineStepError(f"the engine step failed: {type(err).__name__}: {err}")
                failure.__cause__ = err
                self.fail(None, failure)
                continue
            for delta in deltas:
                self.deliver(delta)


def abort_deltas(engine: Engine, request_id: str) -> list[RequestDelta]:
    """Abort a request in ``engine``.

    Args:
        engine: the engine holding it.
        request_id: the request's id.

    Returns:
        The ``"abort"`` deltas of its open samples (none if it is unknown or done).
    """
    seqs = engine.requests.get(request_id, [])
    done = {s.index for s in seqs if s.finish_reason is not None}
    if not engine.abort(request_id):
        return []
    # Samples not forked yet (n > 1 before the first token) end here too.
    return [RequestDelta(request_id, i, [], "", "abort") for i in range(seqs[0].spec.n) if i not in done]


def forget_finished(engine: Engine, deltas: list[RequestDelta]) -> None:
    """Drop the requests whose every sample has finished from ``engine.requests`` (their deltas are out).

    Args:
        engine: the engine.
        deltas: the deltas of the last step.
    """
    for request_id in {d.request_id for d in deltas if d.finish_reason is not None}:
        if all(s.finish_reason is not None for s in engine.requests.get(request_id, [])):
            engine.requests.pop(request_id, None)


def abort_all(engine: Engine) -> list[str]:
    """After a step raised: abort every request in the engine (its blocks freed) and forget it.

    Args:
        engine: the engine.

    Returns:
        The ids of the requests dropped.
    """
    ids = list(engine.requests)
    for request_id in ids:
        try:
            engine.abort(request_id)
        except Exception:  # noqa: BLE001 - the step left this request half-updated; drop it regardless
            pass
        engine.requests.pop(request_id, None)
    return ids


def lora_action(engine: Engine, action: str, name: str, path: Any) -> Exception | None:
    """Apply ``engine.add_lora(name, path)`` or ``engine.remove_lora(name)``.

    Args:
        engine: the engine.
        action: ``"add"`` or ``"remove"``.
        name: the adapter's name.
        path: where to read it from (``"add"``).

    Returns:
        The error it raised (``ValueError``, ``FileNotFoundError`` …), or None.
    """
    try:
        if action == "add":
            engine.add_lora(name, path)
        else:
            engine.remove_lora(name)
    except Exception as err:  # noqa: BLE001 - handed to the caller; the engine and its requests go on
        return err
    return None


def call_on(engine: Engine, fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """Run ``fn(engine, *args)`` for a front (``AsyncEngine.call``, ``ProcessEngine.call``); a failure is reported,
    never raised, so that the engine goes on.

    Args:
        engine: the engine.
        fn: the function.
        *args: its other arguments.

    Returns:
        ``("ok", result)``, ``("value", message)`` for a ``ValueError``, or ``("error", message)`` for another
        exception.
    """
    try:
        return "ok", fn(engine, *args)
    except ValueError as err:
        return "value", str(err)
    except Exception as err:  # noqa: BLE001 - this call fails, the engine goes on
        return "error", f"{type(err).__name__}: {err}"
