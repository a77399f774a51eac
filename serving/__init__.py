"""Serving: continuous batching over a paged KV cache (``Engine``) and its async front (``AsyncEngine``)."""

from .engine import Engine, QueueFullError
from .requests import RequestDelta, RequestOutput, TokenLogprob

__all__ = ["Engine", "QueueFullError", "RequestDelta", "RequestOutput", "TokenLogprob"]
