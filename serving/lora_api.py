"""LoRA adapters over HTTP, as vLLM serves them: chosen by the request's ``model``, listed by ``/v1/models``,
loaded and unloaded while serving.

- A request whose ``model`` is an adapter's name runs with that adapter (the base model's name: no adapter).
- ``GET /v1/models`` lists each adapter after the base model, with ``parent`` = the base model and ``root`` = where
  it was loaded from.
- ``POST /v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}`` and ``POST /v1/unload_lora_adapter``
  ``{"lora_name": ...}`` (vLLM's paths and bodies; behind the API key like every ``/v1/`` path). An adapter that does
  not fit the base model is a 400 naming what does not fit; requests running meanwhile are not disturbed; an
  adapter unloaded while requests use it stays until they end.
- ``/metrics``: ``zoo_lora_requests_total`` and ``zoo_lora_generation_tokens_total`` by ``adapter``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict

from .protocol import APIError


class LoadLoRARequest(BaseModel):
    """vLLM's body of ``POST /v1/load_lora_adapter``."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    """vLLM's body of ``POST /v1/unload_lora_adapter`` (``lora_int_id`` is not used here)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str


class ServedLoRAs:
    """The adapters a server offers (name -> where from) and their per-adapter counters.

    Args:
        model_name: the base model's name.
        loras: the adapters the engine was started with, name -> folder or Hub repo.
        registry: the server's Prometheus registry.
    """

    def __init__(self, model_name: str, loras: dict[str, Any] | None, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        self.paths = {name: os.fspath(path) if isinstance(path, (str, os.PathLike)) else "<memory>"
                      for name, path in (loras or {}).items()}
        self.created = {name: int(time.time()) for name in self.paths}
        self.requests = Counter("zoo_lora_requests", "Requests per LoRA adapter", ["adapter"], registry=registry)
        self.tokens = Counter("zoo_lora_generation_tokens", "Tokens generated per LoRA adapter", ["adapter"],
                              registry=registry)

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names.

        Args:
            model: the request's ``model`` field.

        Returns:
            The adapter's name, or None for the base model.

        Raises:
            APIError: 404 for a name that is neither.
        """
        if model == self.model_name:
            return None
        if model in self.paths:
            return model
        known = [self.model_name, *self.paths]
        raise APIError(404, f"the model {model!r} does not exist; this server serves {known}", param="model",
                       code="model_not_found")

    def models(self) -> list[dict[str, Any]]:
        """The ``/v1/models`` entries of the adapters.

        Returns:
            One OpenAI model object per adapter, with ``parent`` and ``root``.
        """
        return [{"id": name, "object": "model", "created": self.created[name], "owned_by": "transformer-zoo",
                 "root": path, "parent": self.model_name} for name, path in self.paths.items()]

    def count(self, adapter: str | None, tokens: int = 0, request: bool = False) -> None:
        """Count a request or generated tokens of an adapter.

        Args:
            adapter: its name (None: the base model, not counted).
            tokens: tokens generated.
            request: count one request.
        """
        if adapter is None:
            return
        if request:
            self.requests.labels(adapter=adapter).inc()
        if tokens:
            self.tokens.labels(adapter=adapter).inc(tokens)


def add_lora_routes(app: FastAPI, loras: ServedLoRAs, front: Any) -> None:
    """Add ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` to ``app``.

    Args:
        app: the server's application.
        loras: the served adapters (updated as they load and unload).
        front: returns the engine's front (``AsyncEngine`` or ``ProcessEngine``).
    """

    async def act(action: str, name: str, path: Any = None) -> None:
        engine = front()
        try:
            await engine.lora(action, name, path)
        except (ValueError, OSError) as err:
            status = 404 if action == "remove" and "is not loaded" in str(err) else 400
            param = "lora_path" if action == "add" and "lora_name" not in str(err) else "lora_name"
            raise APIError(status, f"{type(err).__name__}: {err}" if isinstance(err, OSError) else str(err),
                           param=param, code="invalid_lora" if status == 400 else "lora_not_found") from err

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> PlainTextResponse:
        if body.lora_name == loras.model_name or body.lora_name in loras.paths:
            raise APIError(400, f"lora_name={body.lora_name!r} is already loaded (or is the base model); unload it "
                                "first", param="lora_name", code="invalid_lora")
        await act("add", body.lora_name, body.lora_path)
        loras.paths[body.lora_name] = body.lora_path
        loras.created[body.lora_name] = int(time.time())
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> PlainTextResponse:
        if body.lora_name not in loras.paths:
            raise APIError(404, f"the LoRA adapter {body.lora_name!r} is not loaded; loaded: {list(loras.paths)}",
                           param="lora_name", code="lora_not_found")
        await act("remove", body.lora_name)
        del loras.paths[body.lora_name]
        loras.created.pop(body.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
