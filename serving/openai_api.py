"""An OpenAI-compatible HTTP server over the engine (FastAPI): what every OpenAI client speaks.

``create_app(model, tokenizer, ...)`` serves one model:

- ``POST /v1/chat/completions`` (the tokenizer's chat template, ``tokenization.chat``) and ``POST /v1/completions``
  (``echo`` with the prompt's log-probabilities, as lm-eval's ``local-completions`` reads them:
  ``serving.completions_echo``), both with ``stream=true`` as server-sent events ending with ``data: [DONE]`` (and a
  usage chunk when ``stream_options.include_usage``), over the engine's continuous batching: ``ProcessEngine`` (the
  engine in its own process; ``engine_process=``) or ``AsyncEngine`` (the engine stepped by a thread of the server's
  process);
- ``POST /v1/embeddings`` for a model with an ``embedding`` head (``model.embed``);
- LoRA adapters chosen by ``model``, listed by ``/v1/models``, loaded and unloaded while serving (``serving.lora_api``);
- ``GET /v1/models``, ``GET /health`` (503 until the model is set and the engine ready, or once the engine process
  has died), ``GET /metrics`` (Prometheus; time to first token and queue time from the request's arrival);
- ``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (``serving.tokenize_api``).

Fields: every OpenAI-defined field is honoured (sampling, penalties over the generated tokens as OpenAI defines
them, ``logprobs``, ``logit_bias``, ``response_format`` / ``structured_outputs``, ``tools``: ``serving.structured``)
or a 400 naming it (``serving.openai_fields``); keys OpenAI does not define are ignored. Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field or a prompt longer than the context, 401 for
a missing or wrong API key, 404 for an unknown model, 503 when the queue is full or the engine is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, EngineDeadError, EngineStepError
from .completions_echo import LegacyLogprobs, echo_only, echo_prompts
from .embeddings_api import add_embedding_routes
from .engine import Engine, QueueFullError
from .engine_process import ModelSource, ProcessEngine
from .lora_api import ServedLoRAs, add_lora_routes
from .metrics import ServerMetrics
from .openai_fields import check_openai_fields
from .protocol import (
    RETRY_AFTER_S,
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    arrival_of,
    flatten_content,
    param_of,
    refuse_surrogates,
    sampling_params,
    usage,
)
from .structured import ToolPlan, answer, response_constraint, template_messages, tool_plan
from .tokenize_api import add_tokenize_routes
from .tool_parsers import parser_for

START = time.time()  # the `created` of /v1/models


def create_app(model: Any = None, tokenizer: Any = None, *, model_name: str = "model", api_key: str | None = None,
               engine_process: bool | ModelSource = False, tool_call_parser: str | None = None,
               **engine_limits: Any) -> FastAPI:
    """The FastAPI application serving ``model`` as ``model_name``.

    Args:
        model: the model; None: set later (``app.state.load(model, tokenizer)``), ``/health`` answers 503 until then.
        tokenizer: its tokenizer (None: the model's own).
        model_name: the name requests give as ``model``.
        api_key: the bearer key ``/v1/`` routes require (None: none).
        engine_process: run the engine in its own process (``ProcessEngine``), which builds the model from this
            ``ModelSource`` (``True``: from a copy of ``model``'s weights, ``ModelSource.from_model``); the server
            then reads only ``model.config``, so ``model`` may be on the meta device. False: the engine runs in this
            process, stepped by a worker thread (``AsyncEngine``). Models with an embedding head always run here.
        tool_call_parser: the ``serving.tool_parsers`` parser of tool calls (default: chosen from the template).
        **engine_limits: ``Engine`` arguments (``max_num_seqs``, ``num_blocks``, ``block_size``, ``loras`` …).

    Returns:
        The application (``uvicorn.run(app)``).

    Raises:
        ValueError: an unknown ``tool_call_parser``, or engine arguments the engine refuses.
    """
    parser_for(None, tool_call_parser)  # an unknown parser name fails here, before serving
    metrics = ServerMetrics()
    loras = ServedLoRAs(model_name, engine_limits.get("loras"), metrics.registry)  # serving.lora_api
    state: dict[str, Any] = {"model": None, "engine": None, "tokenizer": None}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state["engine"] is not None:
            await state["engine"].start()  # the engine process has loaded the model before the port opens
        yield
        if state["engine"] is not None:
            await state["engine"].close()

    app = FastAPI(title="transformer-zoo", docs_url=None, redoc_url=None, lifespan=lifespan)

    def load(model: Any, tokenizer: Any = None) -> None:
        state.update(model=model, tokenizer=tokenizer if tokenizer is not None else getattr(model, "tokenizer", None))
        if getattr(model.config, "head", None) != "embedding":
            if engine_process is not False:
                source = engine_process if isinstance(engine_process, ModelSource) else ModelSource.from_model(model)
                front: Any = ProcessEngine(source, state["tokenizer"], **engine_limits)
            else:
                front = AsyncEngine(Engine(model.eval(), state["tokenizer"], **engine_limits))
            state["engine"] = app.state.engine = front
            metrics.bind(front)

    app.state.load = load
    if model is not None:
        load(model, tokenizer)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (an undecodable body, an unknown path or method) in OpenAI's shape.
        type_ = "invalid_request_error" if err.status_code < 500 else "server_error"
        return APIError(err.status_code, str(err.detail), type_=type_).response()

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        # A bug or an unexpected failure in one request: that request gets a 500, the server keeps serving.
        return APIError(500, f"internal error: {type(err).__name__}: {err}", type_="server_error",
                        code="internal_error").response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(where) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), None
        return APIError(400, message, param=param, code="invalid_request").response()

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        request.state.arrival = time.perf_counter()  # the clock of time-to-first-token and queue time
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                                code="invalid_api_key").response()
        return await call_next(request)

    def check_model(name: str) -> str | None:
        """The LoRA adapter the request's ``model`` names (None: the base model)."""
        if state["model"] is None:
            raise APIError(503, "the model is still loading", type_="server_error", code="model_loading")
        return loras.adapter_of(name)

    def engine() -> AsyncEngine | ProcessEngine:
        if state["engine"] is None:
            raise APIError(400, f"{model_name!r} has an embedding head: it answers /v1/embeddings only",
                           param="model")
        return state["engine"]

    add_lora_routes(app, loras, engine)

    @app.get("/health")
    async def health() -> Response:
        front = state["engine"]
        if front is not None:
            front.listen()
            if not front.alive:
                return JSONResponse({"status": "error", "message": front.failure}, status_code=503)
        if state["model"] is None or (front is not None and not front.ready):
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(START),
                                             "owned_by": "transformer-zoo"}, *loras.models()]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def submit(prompt: Any, body: SamplingFields, max_tokens: int | None,
                     logprobs: int | None, arrival: float, constraint: Any = None,
                     adapter: str | None = None) -> tuple[str, int]:
        """Queue one prompt; return the request id and its prompt length."""
        eng = engine()
        try:
            await eng.start()  # the engine process's model is loaded (at once for an in-process engine)
        except EngineDeadError as err:
            raise APIError(503, f"the engine is not running: {err}", type_="server_error", code="engine_dead") from err
        sampling = sampling_params(body)
        tok = state["tokenizer"]
        if isinstance(prompt, str):
            if tok is None:
                raise APIError(400, "this server has no tokenizer: send prompts as token ids", param="prompt")
            prompt = list(tok.encode(prompt))
        context = eng.context
        if isinstance(prompt, list) and len(prompt) >= context:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; the model's context is {context} tokens "
                                "(one is needed for the answer)", param="prompt")
        if max_tokens is None:
            max_tokens = max(1, context - len(prompt))
        elif isinstance(prompt, list) and len(prompt) + max_tokens > context:
            raise APIError(400, f"the prompt's {len(prompt)} tokens + max_tokens={max_tokens} exceed the model's "
                                f"context of {context} tokens", param="max_tokens")
        try:
            request_id = await eng.add_request(prompt, sampling, max_tokens=max_tokens, stop=body.stop, n=body.n,
                                               seed=body.seed, logprobs=logprobs, constraint=constraint,
                                               logit_bias=body.logit_bias,
                                               **({} if adapter is None else {"adapter": adapter}))
        except QueueFullError as err:
            raise APIError(503, f"the server is busy: {err}", type_="server_error", code="queue_full",
                           retry_after=RETRY_AFTER_S) from err
        except EngineDeadError as err:
            raise APIError(503, f"the engine is not running: {err}", type_="server_error", code="engine_dead") from err
        except ValueError as err:
            raise APIError(400, str(err), param=param_of(str(err))) from err
        metrics.received(len(prompt))
        metrics.queue_time.observe(time.perf_counter() - arrival)
        loras.count(adapter, request=True)
        return request_id, len(prompt)

    def token_text(token_id: int) -> str:
        tok = state["tokenizer"]
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)

    async def run(prompts: list[Any], body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                  chat: bool, arrival: float, constraint: Any = None, plan: ToolPlan | None = None,
                  adapter: str | None = None, echo: list[Any] | None = None) -> Response:
        kind = "chatcmpl" if chat else "cmpl"
        response_id, created = f"{kind}-{uuid.uuid4().hex}", int(time.time())
        check_openai_fields(body.model_extra, body.n)
        submitted = [await submit(p, body, max_tokens, logprobs, arrival, constraint, adapter) for p in prompts]
        served = model_name if adapter is None else adapter
        streams = [(i, request_id) for i, (request_id, _) in enumerate(submitted)]
        prompt_tokens = sum(n for _, n in submitted)
        want_logprobs = logprobs is not None
        legacy = LegacyLogprobs(token_text)  # the completions' logprobs (serving.completions_echo)

        def logprob_json(entries: list[Any]) -> Any:
            if not want_logprobs or entries is None:
                return None
            return {"content": [{
                "token": token_text(e.token_id), "logprob": e.logprob, "bytes": list(token_text(e.token_id).encode()),
                "top_logprobs": [{"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())}
                                 for t, lp in e.top.items()],
            } for e in entries]}

        def choice(index: int, text: str, entries: Any, finish: str | None, first: bool, stream: bool,
                   ids: Any = None) -> dict:
            reason = None if finish is None else ("stop" if finish == "abort" else finish)
            if chat:
                key = "delta" if stream else "message"
                message: dict[str, Any] = {"content": text}
                if plan is not None and finish is not None:  # the answer is whole: read its tool calls
                    message["content"], calls = answer(plan, state["tokenizer"], ids or [], text, stream)
                    if calls:
                        message["tool_calls"], reason = calls, "tool_calls"
                if first or not stream:
                    message["role"] = "assistant"
                return {"index": index, key: message, "logprobs": logprob_json(entries), "finish_reason": reason}
            prompt = echo[index // body.n] if echo is not None and first else None  # echoed before the first text
            rows = [*((prompt and prompt.rows) or []), *((e.token_id, e.logprob, e.top) for e in entries or [])]
            return {"index": index, "text": (prompt.text if prompt else "") + text, "finish_reason": reason,
                    "logprobs": legacy.json(index, rows) if want_logprobs and (entries is not None or prompt) else None}

        obj = ("chat.completion" if chat else "text_completion")

        async def deltas() -> AsyncIterator[tuple[int, Any]]:
            """(choice index, delta) of every request, interleaved as they come."""
            def observed(request_id: str) -> AsyncIterator[Any]:
                """The request's deltas, each counted in the metrics (time to first token, inter-token latency)."""
                clock = {"started": arrival}  # the request's arrival, not its acceptance by the engine
                clock["last"] = clock["started"]

                async def each() -> AsyncIterator[Any]:
                    async for delta in state["engine"].stream(request_id):
                        if delta.finish_reason == "error":
                            raise EngineStepError("no next token could be chosen for this request (NaN logits, or "
                                                  "a failure in its own sampling step); other requests are "
                                                  "unaffected")
                        now = time.perf_counter()
                        if delta.token_ids:
                            metrics.observe_tokens(len(delta.token_ids), now - clock["started"], now - clock["last"],
                                                   first=clock["last"] == clock["started"])
                            clock["last"] = now
                            loras.count(adapter, len(delta.token_ids))
                        if delta.finish_reason is not None:
                            metrics.e2e.observe(time.perf_counter() - arrival)
                        yield delta

                return each()

            if len(streams) == 1:  # one prompt: its deltas directly, without a task and a queue per token
                try:
                    async for delta in observed(streams[0][1]):
                        yield delta.index, delta
                finally:
                    state["engine"].abort(streams[0][1])  # no-op when finished; a dropped client's blocks are freed
                return

            queue: asyncio.Queue = asyncio.Queue()

            async def pump(prompt_index: int, request_id: str) -> None:
                try:
                    async for delta in observed(request_id):
                        await queue.put((prompt_index * body.n + delta.index, delta))
                except EngineStepError as err:
                    await queue.put(err)
                finally:
                    await queue.put(None)

            tasks = [asyncio.create_task(pump(i, rid)) for i, rid in streams]
            try:
                remaining = len(tasks)
                while remaining:
                    item = await queue.get()
                    if item is None:
                        remaining -= 1
                    elif isinstance(item, EngineStepError):
                        raise item
                    else:
                        yield item
            finally:
                for task in tasks:
                    task.cancel()
                for _, request_id in streams:
                    state["engine"].abort(request_id)  # no-op for finished requests; a dropped client's are freed

        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage

            async def events() -> AsyncIterator[str]:
                started: set[int] = set()
                completion_tokens = 0
                try:
                    held: dict[int, tuple[str, list[int], list[Any]]] = {}  # answers read for tool calls at the end
                    async for index, delta in deltas():
                        completion_tokens += len(delta.token_ids)
                        text, ids, entries = delta.text, delta.token_ids, delta.logprobs
                        if plan is not None and plan.choice != "none":
                            text, ids, entries = (a + b for a, b in zip(held.get(index, ("", [], [])), (
                                text, ids, entries or []), strict=True))
                            held[index] = (text, ids, entries)
                            if delta.finish_reason is None:
                                continue
                        chunk = {"id": response_id, "object": obj + ("" if not chat else ".chunk"), "created": created,
                                 "model": served,
                                 "choices": [choice(index, text, entries, delta.finish_reason,
                                                    index not in started, True, ids)]}
                        started.add(index)
                        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                except EngineStepError as err:  # the status is sent already: an error event, then the end
                    error = {"error": {"message": str(err), "type": "server_error", "param": None,
                                       "code": "engine_error"}}
                    yield f"data: {json.dumps(error)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if include_usage:
                    last = {"id": response_id, "object": obj + ("" if not chat else ".chunk"), "created": created,
                            "model": served, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        texts: dict[int, list[str]] = {}
        entries: dict[int, list[Any]] = {}
        finish: dict[int, str] = {}
        token_ids: dict[int, list[int]] = {}
        completion_tokens = 0
        async for index, delta in deltas():
            texts.setdefault(index, []).append(delta.text)
            token_ids.setdefault(index, []).extend(delta.token_ids)
            entries.setdefault(index, []).extend(delta.logprobs or [])
            completion_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                finish[index] = delta.finish_reason
        choices = [choice(i, "".join(texts.get(i, [])), entries.get(i), finish.get(i, "stop"), True, False,
                          token_ids.get(i)) for i in range(len(prompts) * body.n)]
        return JSONResponse({"id": response_id, "object": obj, "created": created, "model": served,
                             "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        refuse_surrogates(body)
        adapter = check_model(body.model)
        prompt = body.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 generates nothing: expected >= 1 (0 only with echo=true)",
                           param="max_tokens")
        # response_format is a chat field; honoured here too (as vLLM does) rather than ignored.
        constraint = response_constraint((body.model_extra or {}).get("response_format"), body.structured_outputs)
        check_openai_fields(body.model_extra, body.n)
        echo = await echo_prompts(engine(), prompts, state["tokenizer"], body.logprobs, adapter) if body.echo else None
        if echo is not None and body.max_tokens == 0:
            return echo_only(echo, body.n, body.model, LegacyLogprobs(token_text), body.stream,
                             body.stream_options is not None and body.stream_options.include_usage)
        return await run(prompts, body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs,
                         chat=False, arrival=arrival_of(request), constraint=constraint, adapter=adapter, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        refuse_surrogates(body)
        adapter = check_model(body.model)
        tok = state["tokenizer"]
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise APIError(400, f"{model_name!r} has no chat template: use /v1/completions", param="messages")
        constraint = response_constraint(body.response_format, body.structured_outputs)
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                         parser_for(tok.chat_template, tool_call_parser))
        if plan is not None and plan.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice={body.tool_choice!r} constrains the answer to a tool call: drop "
                                    "response_format / structured_outputs", param="tool_choice")
            constraint = plan.constraint
        try:
            # In a worker thread: a template that runs to its time limit (a second) does not stall the event loop.
            ids = await asyncio.to_thread(tok.apply_chat_template, template_messages(flatten_content(body.messages)),
                                          add_generation_prompt=True, tools=None if plan is None else plan.tools)
        except ValueError as err:
            raise APIError(400, f"messages: {err}", param="messages") from err
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await run([ids], body, max_tokens, logprobs, chat=True, arrival=arrival_of(request),
                         constraint=constraint, plan=plan, adapter=adapter)

    add_embedding_routes(app, state, check_model, model_name)
    add_tokenize_routes(app, state, check_model, lambda: getattr(state["engine"], "context", 0) or
                        getattr(getattr(state["model"], "config", None), "max_len", 0))
    return app
