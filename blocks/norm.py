"""Normalisation layers."""

from __future__ import annotations

from torch import nn

from .registry import register


@register("norm", "layernorm")
class LayerNorm(nn.LayerNorm):
    """Layer normalisation (Ba et al. 2016), as in the paper."""

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(d_model, eps=eps, bias=bias)


@register("norm", "rmsnorm")
class RMSNorm(nn.RMSNorm):
    """Root-mean-square normalisation (Zhang & Sennrich 2019): no centring, no bias."""

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__(d_model, eps=eps)
