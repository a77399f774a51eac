"""Normalisation layers."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .registry import register


@register("norm", "layernorm")
class LayerNorm(nn.LayerNorm):
    """Layer normalisation (Ba et al. 2016), as in the paper; ``bias=False`` for ModernBERT-style norms.

    Args:
        d_model: the normalised width.
        eps: added to the variance.
        bias: learn a bias beside the scale.

    Shapes: ``(..., d_model)`` -> same.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(d_model, eps=eps, bias=bias)


@register("norm", "rmsnorm")
class RMSNorm(nn.RMSNorm):
    """Root-mean-square normalisation (Zhang & Sennrich 2019): no centring, no bias.

    Args:
        d_model: the normalised width.
        eps: added to the mean square.

    Shapes: ``(..., d_model)`` -> same.
    """

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__(d_model, eps=eps)


@register("norm", "rmsnorm_offset")
class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by ``(1 + weight)`` with the weight initialised to 0 (Gemma), computed in float32.

    Args:
        d_model: the normalised width.
        eps: added to the mean square.

    Shapes: ``(..., d_model)`` -> same.
    """

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@register("norm", "identity")
class IdentityNorm(nn.Identity):
    """No normalisation (a sublayer whose input is already normalised, e.g. ModernBERT's first attention).

    Args:
        d_model: accepted for the norms' common signature, unused.
        eps: accepted for the norms' common signature, unused.

    Shapes: ``(...)`` -> same.
    """

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
