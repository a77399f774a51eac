"""``echo`` for ``POST /v1/completions``, and the completions API's (legacy) ``logprobs`` object.

With ``echo=true`` each choice's text starts with its prompt; with ``logprobs=N`` too, the prompt's tokens come
first in ``choices[i].logprobs`` — ``tokens``, ``token_logprobs`` (None for the first token: nothing comes before
it), ``top_logprobs`` (None for the first) and ``text_offset`` — scored by one forward pass of the engine's model
(``serving.prompt_logprobs``), then the generated tokens. ``max_tokens=0`` with ``echo`` scores the prompt and
generates nothing. This is what lm-evaluation-harness's ``local-completions`` backend sends for its log-likelihoods
(``echo``, ``logprobs=1``, ``max_tokens=1``; it reads the continuation's entries and checks each against the
largest of its ``top_logprobs`` for ``is_greedy``).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from .async_engine import EngineDeadError
from .prompt_logprobs import score_prompts
from .protocol import APIError, top_by_text, usage

#: One token of a ``logprobs`` object: its id, its log-probability and the top ones (None for a prompt's first).
Row = tuple[int, float | None, dict[int, float] | None]


@dataclasses.dataclass(frozen=True)
class Echo:
    """A prompt as a choice echoes it.

    Attributes:
        text: the prompt's text (decoded, for a prompt of token ids).
        token_ids: its tokens.
        rows: its tokens' ``logprobs`` rows, or None when the request asked for no log-probabilities.
    """

    text: str
    token_ids: list[int]
    rows: list[Row] | None


async def echo_prompts(front: Any, prompts: list[Any], tokenizer: Any, logprobs: int | None,
                       adapter: str | None) -> list[Echo]:
    """Tokenize and (with ``logprobs``) score the prompts of an ``echo`` request on the engine between two steps.

    Args:
        front: the ``AsyncEngine`` or ``ProcessEngine`` (its ``call``).
        prompts: the request's prompts, text or token ids.
        tokenizer: the server's tokenizer (None: prompts must be token ids).
        logprobs: top log-probabilities per token (None: the prompt is not scored).
        adapter: the LoRA adapter the request names (None: the base model).

    Returns:
        One ``Echo`` per prompt.

    Raises:
        APIError: 400 for prompt log-probabilities asked of an adapter, text without a tokenizer or a bad prompt;
            503 when the engine is not running.
    """
    if logprobs is not None and adapter is not None:
        raise APIError(400, f"echo with logprobs scores prompts with the base model only, not the adapter "
                            f"{adapter!r}", param="model")
    ids, texts = [], []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "this server has no tokenizer: send prompts as token ids", param="prompt")
            ids.append(list(tokenizer.encode(prompt)))
            texts.append(prompt)
        else:
            ids.append(list(prompt))
            try:
                texts.append("" if tokenizer is None else tokenizer.decode(ids[-1], skip_special_tokens=False))
            except ValueError as err:  # an id outside the vocabulary
                raise APIError(400, f"prompt: {err}", param="prompt") from err
    scored: list[Any] = [None] * len(ids)
    if logprobs is not None:
        try:
            scored = await front.call(score_prompts, ids, logprobs)
        except EngineDeadError as err:
            raise APIError(503, f"the engine is not running: {err}", type_="server_error", code="engine_dead") from err
        except ValueError as err:
            raise APIError(400, f"{err}", param="prompt") from err
    return [Echo(text, tokens, None if entries is None else [
        (t, None, None) if e is None else (e.token_id, e.logprob, e.top) for t, e in zip(tokens, entries, strict=True)])
        for text, tokens, entries in zip(texts, ids, scored, strict=True)]


class LegacyLogprobs:
    """The completions API's ``logprobs`` objects of one response; ``text_offset`` runs on across the chunks of
    each choice (the offset of each token's text in the choice's text, the echoed prompt included).

    Args:
        token_text: a function from a token id to its text.
    """

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text
        self.offsets: dict[int, int] = {}

    def json(self, index: int, rows: list[Row]) -> dict[str, list[Any]]:
        """The ``logprobs`` object of the next tokens of choice ``index``.

        Args:
            index: the choice.
            rows: its next tokens (echoed prompt tokens first).

        Returns:
            ``tokens``, ``token_logprobs``, ``top_logprobs`` (keyed by token text) and ``text_offset``.
        """
        texts = [self.token_text(token) for token, _, _ in rows]
        offsets, at = [], self.offsets.get(index, 0)
        for text in texts:
            offsets.append(at)
            at += len(text)
        self.offsets[index] = at
        return {"tokens": texts, "token_logprobs": [logprob for _, logprob, _ in rows],
                "top_logprobs": [None if top is None else top_by_text(top, self.token_text) for _, _, top in rows],
                "text_offset": offsets}


def echo_only(echoes: list[Echo], n: int, model: str, legacy: LegacyLogprobs, stream: bool,
              include_usage: bool) -> Response:
    """The answer to ``max_tokens=0`` with ``echo``: each prompt ``n`` times, nothing generated.

    Args:
        echoes: the prompts (``echo_prompts``).
        n: choices per prompt.
        model: the served model's name.
        legacy: the response's ``logprobs`` builder.
        stream: answer as server-sent events (one chunk per choice, then ``[DONE]``).
        include_usage: with ``stream``, a last chunk with the token counts.

    Returns:
        The response.
    """
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model}
    choices = [{"index": i, "text": echo.text, "finish_reason": "length",
                "logprobs": None if echo.rows is None else legacy.json(i, echo.rows)}
               for i, echo in enumerate(e for e in echoes for _ in range(n))]
    counts = usage(sum(len(e.token_ids) for e in echoes), 0)
    if not stream:
        return JSONResponse({**head, "choices": choices, "usage": counts})

    async def events() -> AsyncIterator[str]:
        for choice in choices:
            yield f"data: {json.dumps({**head, 'choices': [choice]}, ensure_ascii=False)}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': counts})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
