"""The OpenAI API's shapes for the server: request bodies (pydantic), errors, usage and the sampling fields as
the zoo's ``SamplingParams``."""

from __future__ import annotations

import re
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from models.generation.sampling import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape.

    Args:
        status: the HTTP status code.
        message: the error's text.
        type_: OpenAI's error type (``invalid_request_error``, ...).
        param: the request field at fault, if any.
        code: OpenAI's error code, if any.
        retry_after: seconds to send as ``Retry-After`` (None: no such header).
    """

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        """The JSON response ``{"error": {"message", "type", "param", "code"}}`` with this error's status.

        Returns:
            The response, with ``Retry-After`` when ``retry_after`` is set.
        """
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = None if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return JSONResponse(body, status_code=self.status, headers=headers)


#: Seconds a client is asked to wait (``Retry-After``) when the waiting queue is full.
RETRY_AFTER_S = 1


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields the completions and chat bodies share: the model, the sampling fields and streaming."""

    # Undeclared fields are kept: serving.openai_fields refuses the OpenAI-defined ones the server does not honour.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # OpenAI's range (int64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # checked by serving.guided.check_logit_bias
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension (serving.structured)


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo (the prompt scored, nothing generated)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class EmbeddingRequest(BaseModel):
    """The body of ``POST /v1/embeddings``."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"


def sampling_params(body: SamplingFields) -> SamplingParams:
    """OpenAI's sampling fields as the zoo's ``SamplingParams`` (temperature 0 is greedy; default 1; the presence
    and frequency penalties apply to greedy decoding too).

    Args:
        body: the request's body.

    Returns:
        The sampling parameters.

    Raises:
        APIError: 400 for a ``top_k`` below 1 other than -1.
    """
    if body.top_k is not None and body.top_k != -1 and body.top_k < 1:
        raise APIError(400, f"top_k={body.top_k}: expected an integer >= 1 (or -1 for all)", param="top_k")
    temperature = 1.0 if body.temperature is None else body.temperature
    penalties = {"presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty}
    if temperature == 0.0:
        return SamplingParams(**penalties)
    top_k = None if body.top_k in (None, -1) else body.top_k
    return SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=body.top_p, **penalties)


def flatten_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content given as parts (``[{"type": "text", "text": ...}]``) joined to the string templates expect.

    Args:
        messages: the chat messages of the request.

    Returns:
        The messages, each content a string (or None).

    Raises:
        APIError: 400 naming ``messages[i].role`` or ``messages[i].content``: a role that is not a string, content
            that is neither a string, a list of text parts nor null.
    """
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}].role: expected a string, got {message.get('role')!r:.60}",
                           param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            message = {**message, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content: expected a string or a list of text parts, got "
                                f"{type(content).__name__} {content!r:.60}", param=f"messages[{i}].content")
        out.append(message)
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def refuse_surrogates(body: BaseModel) -> None:
    """Refuse text holding a lone surrogate (``"\\ud800"`` in the JSON): it is not Unicode text, no tokenizer can
    encode it and no answer could quote it.

    Args:
        body: the request's body (every string in it is checked).

    Raises:
        APIError: 400 naming the field (``messages[0].content``, ``prompt``, ``stop[1]`` …).
    """
    stack: list[tuple[str, Any]] = [("", body.model_dump())]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found is not None:
                raise APIError(400, f"{path}: a lone surrogate {found.group()!r} at character {found.start()}; "
                                    "expected Unicode text (UTF-8)", param=path)
        elif isinstance(value, dict):
            stack += [(f"{path}.{key}" if path else str(key), item) for key, item in value.items()]
            stack += [(path or "body", key) for key in value if isinstance(key, str)]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{path}[{i}]", item) for i, item in enumerate(value)]


def top_by_text(top: dict[int, float], text: Any) -> dict[str, float]:
    """Top log-probabilities keyed by token text (the completions API's shape); ids that decode alike (parts of
    one character) keep the largest.

    Args:
        top: token id -> log-probability.
        text: a function from a token id to its text.

    Returns:
        Token text -> log-probability.
    """
    out: dict[str, float] = {}
    for token, logprob in top.items():
        key = text(token)
        out[key] = max(logprob, out.get(key, logprob))
    return out


def usage(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's ``usage`` object.

    Args:
        prompt: the number of prompt tokens.
        completion: the number of generated tokens.

    Returns:
        ``prompt_tokens``, ``completion_tokens`` and ``total_tokens``.
    """
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def param_of(message: str) -> str | None:
    """The request field an engine error names (its messages start with the argument's name).

    Args:
        message: the text of the engine's ``ValueError``.

    Returns:
        The field's name, or None when the message names none.
    """
    for name in ("max_tokens", "stop", "seed", "logprobs", "logit_bias", "prompt", "n"):
        if re.match(rf"{name}\b", message) or f" {name}=" in message:
            return name
    return "prompt" if "prompt" in message else None


def arrival_of(request: Request) -> float:
    """When the request arrived (stamped by the first middleware; now, for a request that bypassed it).

    Args:
        request: the request.

    Returns:
        ``time.perf_counter()`` at its arrival.
    """
    return getattr(request.state, "arrival", None) or time.perf_counter()
