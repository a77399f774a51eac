"""``POST /v1/embeddings`` for a model with an ``embedding`` head (``model.embed``), in OpenAI's shape: ``float``
vectors or ``base64`` little-endian float32 bytes, the tokens embedded counted in ``usage``."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .protocol import APIError, EmbeddingRequest, refuse_surrogates


def add_embedding_routes(app: FastAPI, state: dict[str, Any], check_model: Callable[[str], str | None],
                         model_name: str) -> None:
    """Add ``/v1/embeddings`` to ``app``.

    Args:
        app: the server's application.
        state: the server's state (``state["model"]``).
        check_model: the LoRA adapter a request's ``model`` names (None: the base model); raises the server's
            ``APIError`` for an unknown name or a model still loading.
        model_name: the served model's name.
    """

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Response:
        refuse_surrogates(body)
        if check_model(body.model) is not None:
            raise APIError(400, f"{body.model!r} is a LoRA adapter; embeddings come from the base model", param="model")
        model = state["model"]
        if getattr(model.config, "head", None) != "embedding":
            raise APIError(400, f"{model_name!r} has no embedding head", param="model")
        if body.encoding_format not in ("float", "base64"):
            raise APIError(400, f"encoding_format={body.encoding_format!r}: expected 'float' or 'base64'",
                           param="encoding_format")
        inputs = body.input
        inputs = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else inputs
        try:
            vectors = await asyncio.to_thread(model.embed, inputs)
            # The tokens embedded, as embed cuts them (no padding a tokenizer.json may add to each text).
            tokens = sum(len(row) for row in model.token_rows(inputs, None, model.embedding_options()))
        except ValueError as err:
            raise APIError(400, f"input: {err}", param="input") from err
        if body.encoding_format == "base64":  # little-endian float32 bytes, as OpenAI sends them
            rows: list[Any] = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in vectors.cpu()]
        else:
            rows = vectors.tolist()
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(rows)]
        return JSONResponse({"object": "list", "data": data, "model": model_name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
