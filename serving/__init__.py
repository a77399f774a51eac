"""Serving: continuous batching over a paged KV cache (``Engine``) and its async front (``AsyncEngine``)."""

from .async_engine import AsyncEngine
from .engine import Engine, QueueFullError
from .requests import RequestDelta, RequestOutput, TokenLogprob

__all__ = ["AsyncEngine", "Engine", "QueueFullError", "RequestDelta", "RequestOutput", "TokenLogprob"]
