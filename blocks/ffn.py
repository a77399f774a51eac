"""Position-wise feed-forward networks (paper §3.3) and their gated descendants (Shazeer 2020)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .registry import register


class FeedForward(nn.Module):
    """``down_proj(dropout(act(up_proj(x))))``: two linear maps with an activation between.

    Shapes: ``(..., d_model)`` -> ``(..., d_model)``.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        if d_model < 1 or d_ff < 1:
            raise ValueError(f"d_model and d_ff must be >= 1, got d_model={d_model}, d_ff={d_ff}")
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def activation(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.dropout(self.activation(self.up_proj(x))))


@register("ffn", "relu")
class ReluFFN(FeedForward):
    """``FFN(x) = max(0, x W1 + b1) W2 + b2`` — the paper's network (§3.3)."""

    def activation(self, x: Tensor) -> Tensor:
        return F.relu(x)


@register("ffn", "gelu")
class GeluFFN(FeedForward):
    """GELU with the exact erf form (BERT)."""

    def activation(self, x: Tensor) -> Tensor:
        return F.gelu(x)


@register("ffn", "gelu_tanh")
class GeluTanhFFN(FeedForward):
    """GELU with the tanh approximation (GPT-2's ``gelu_new``)."""

    def activation(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


@register("ffn", "silu")
class SiluFFN(FeedForward):
    """SiLU/swish activation (Marian's default ``swish``)."""

    def activation(self, x: Tensor) -> Tensor:
        return F.silu(x)


class GatedFeedForward(nn.Module):
    """``down_proj(dropout(act(gate_proj(x)) * up_proj(x)))`` (GLU variants, Shazeer 2020).

    Shapes: ``(..., d_model)`` -> ``(..., d_model)``.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        if d_model < 1 or d_ff < 1:
            raise ValueError(f"d_model and d_ff must be >= 1, got d_model={d_model}, d_ff={d_ff}")
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def activation(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.dropout(self.activation(self.gate_proj(x)) * self.up_proj(x)))


@register("ffn", "swiglu")
class SwiGLUFFN(GatedFeedForward):
    """Swish(SiLU)-gated linear unit."""

    def activation(self, x: Tensor) -> Tensor:
        return F.silu(x)


@register("ffn", "geglu")
class GeGLUFFN(GatedFeedForward):
    """GELU-gated linear unit."""

    def activation(self, x: Tensor) -> Tensor:
        return F.gelu(x)


@register("ffn", "geglu_tanh")
class GeGLUTanhFFN(GatedFeedForward):
    """GELU(tanh approximation)-gated linear unit (Gemma, T5 v1.1 "gated-gelu")."""

    def activation(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")
