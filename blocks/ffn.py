"""Position-wise feed-forward networks (paper §3.3) and their gated descendants (Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quantized.joint import joint_linear
from .registry import register


class FeedForward(nn.Module):
    """``down_proj(dropout(act(up_proj(x))))``: two linear maps with an activation between.

    Args:
        d_model: the model's width.
        d_ff: the inner width.
        dropout: dropout after the activation.
        bias: biases in both linear maps.

    Raises:
        ValueError: ``d_model`` or ``d_ff`` below 1.

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
        """The nonlinearity; each registered subclass defines it.

        Args:
            x: the up projection's output.

        Returns:
            The activated values.

        Raises:
            NotImplementedError: on the base class.

        Shapes: ``(..., d_ff)`` -> same.
        """
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

    Args:
        d_model: the model's width.
        d_ff: the inner width.
        dropout: dropout after the gated product.
        bias: biases in the three linear maps.

    Raises:
        ValueError: ``d_model`` or ``d_ff`` below 1.

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
        """The nonlinearity; each registered subclass defines it.

        Args:
            x: the up projection's output.

        Returns:
            The activated values.

        Raises:
            NotImplementedError: on the base class.

        Shapes: ``(..., d_ff)`` -> same.
        """
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        # GGUF-block projections: gate and up in one kernel call (blocks.quantized.joint_linear).
        gate, up = joint_linear(x, (self.gate_proj, self.up_proj)) or (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.dropout(self.activation(gate) * up))


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


@register("ffn", "clamped_swiglu")
class ClampedSwiGLUFFN(GatedFeedForward):
    """gpt-oss's expert: ``down((clamp(up, ±limit) + 1) · g · sigmoid(alpha · g))`` with ``g = min(gate, limit)``.

    The clamps bound the activations; ``alpha`` makes ``g · sigmoid(alpha · g)`` a GELU-like curve (``1.702`` is the
    sigmoid approximation of GELU), and the ``+ 1`` passes the gated value through where ``up`` is 0.

    Args:
        d_model: the model's width.
        d_ff: the inner width.
        dropout: dropout after the gated product.
        bias: biases in the three linear maps (gpt-oss has them).
        limit: clamp bound (gpt-oss ``swiglu_limit``).
        alpha: sigmoid slope (gpt-oss ``swiglu_alpha``).

    Raises:
        ValueError: ``limit`` or ``alpha`` not a finite number > 0.

    Shapes: ``(..., d_model)`` -> ``(..., d_model)``.
    """

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, bias: bool = False, limit: float = 7.0,
                 alpha: float = 1.702) -> None:
        super().__init__(d_model, d_ff, dropout, bias)
        if not 0 < limit < float("inf") or not 0 < alpha < float("inf"):
            raise ValueError(f"limit and alpha must be finite numbers > 0, got limit={limit!r}, alpha={alpha!r}")
        self.limit, self.alpha = float(limit), float(alpha)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(self.dropout((up + 1) * (gate * torch.sigmoid(gate * self.alpha))))
