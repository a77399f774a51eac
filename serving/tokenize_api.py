"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes (its OpenAI-compatible server's extra routes):

    POST /tokenize    {"model": M, "prompt": "text", "add_special_tokens": true}
                      or {"model": M, "messages": [...], "add_generation_prompt": true}   (the chat template)
                  ->  {"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3]}
    POST /detokenize  {"model": M, "tokens": [1, 2, 3]}  ->  {"prompt": "text"}

Errors have OpenAI's shape, as every route of the server (a missing tokenizer or chat template, an id outside the
vocabulary: 400 naming the field).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .protocol import APIError, flatten_content


class TokenizeRequest(BaseModel):
    """The body of ``/tokenize``: ``prompt`` or ``messages`` (exactly one).

    Attributes:
        model: the served model's name.
        prompt: a text.
        messages: chat messages, through the chat template.
        add_special_tokens: with ``prompt``: the tokenizer's special tokens placed.
        add_generation_prompt: with ``messages``: the template's assistant prefix added.
    """

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def one_input(self) -> TokenizeRequest:
        """Check that exactly one of ``prompt`` and ``messages`` is given.

        Returns:
            The request.

        Raises:
            ValueError: neither or both.
        """
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """The body of ``/detokenize``.

    Attributes:
        model: the served model's name.
        tokens: the ids to decode.
    """

    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[int] = Field(min_length=0)


def add_tokenize_routes(app: FastAPI, state: dict[str, Any], check_model: Callable[[str], None],
                        context: Callable[[], int]) -> None:
    """Add ``/tokenize`` and ``/detokenize`` to ``app``.

    Args:
        app: the server's application.
        state: the server's state (``state["tokenizer"]``, ``state["model"]``).
        check_model: raises the server's ``APIError`` for an unknown model name or a model still loading.
        context: the engine's context in tokens (``max_model_len`` of the answer).
    """

    def tokenizer() -> Any:
        tok = state["tokenizer"]
        if tok is None:
            raise APIError(400, "this server has no tokenizer", param="model")
        return tok

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        tok = tokenizer()
        if body.messages is not None:
            if getattr(tok, "chat_template", None) is None:
                raise APIError(400, "the model has no chat template: tokenize a prompt instead", param="messages")
            try:
                ids = tok.apply_chat_template(flatten_content(body.messages),
                                              add_generation_prompt=body.add_generation_prompt)
            except ValueError as err:
                raise APIError(400, f"messages: {err}", param="messages") from err
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        ids = [int(i) for i in ids]
        return {"count": len(ids), "max_model_len": context(), "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        tok = tokenizer()
        vocab = getattr(tok, "vocab_size", None)
        bad = [t for t in body.tokens if t < 0 or (isinstance(vocab, int) and t >= vocab)]
        if bad:
            raise APIError(400, f"tokens: {bad[:5]} outside the vocabulary of {vocab} tokens", param="tokens")
        try:
            return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
        except ValueError as err:
            raise APIError(400, f"tokens: {err}", param="tokens") from err
