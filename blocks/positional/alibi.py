"""ALiBi: attention with linear biases (Press et al. 2022), as an additive attention bias."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..registry import register
from .base import PositionalEncoding


def alibi_slopes(n_heads: int) -> Tensor:
    """The ALiBi paper's head slopes: for ``n`` a power of two, the geometric sequence starting at
    ``2^(-8/n)`` with that ratio; otherwise the slopes of the nearest lower power of two followed by
    every other slope of the next power of two.

    Args:
        n_heads: the number of heads.

    Returns:
        One slope per head, float32.

    Raises:
        ValueError: ``n_heads`` below 1.

    Shapes: returns ``(n_heads,)``.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        lower = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(lower) + power_of_two(2 * lower)[0::2][: n_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


@register("positional", "alibi")
class ALiBiPositionalBias(PositionalEncoding):
    """Adds ``-slope_h · |i - j|`` to the attention scores of head ``h`` (for causal attention this is
    the paper's ``-slope · (i - j)``; the symmetric form extends it to bidirectional encoders).

    The model's shape arguments are those every positional encoding takes; ALiBi uses ``n_heads``.

    Args:
        d_model: the model's width.
        n_heads: attention heads.
        d_head: width of each head.
        max_len: the longest sequence.
        causal: the stack is causal.

    Shapes: positions ``(B, Lq)``, ``(B, Lk)`` -> bias ``(B, H, Lq, Lk)``.
    """

    def __init__(
        self, d_model: int, n_heads: int = 1, d_head: int | None = None, max_len: int = 512, causal: bool = False
    ) -> None:
        super().__init__()
        self.register_fp32_buffer("slopes", alibi_slopes(n_heads))

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs().float()  # (B, Lq, Lk)
        return -self.slopes[None, :, None, None] * distance[:, None]  # (B, H, Lq, Lk), float32
