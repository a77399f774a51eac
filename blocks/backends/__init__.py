"""Attention backends: pure functions with one signature, registered under ``attention_backend``.

``fn(q, k, v, *, mask=None, bias=None, is_causal=False, dropout_p=0.0, scale=None, softcap=None, sinks=None)``
"""

from .chunked import chunked_attention
from .flex import flex_attention_backend
from .math import math_attention
from .sdpa import sdpa_attention

__all__ = ["chunked_attention", "flex_attention_backend", "math_attention", "sdpa_attention"]
