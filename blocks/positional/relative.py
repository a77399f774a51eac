"""T5's bucketed relative position bias (Raffel et al. 2020, §2.1), an additive attention bias like ALiBi."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..registry import register
from .base import PositionalEncoding


def relative_position_buckets(relative: Tensor, causal: bool, num_buckets: int, max_distance: int) -> Tensor:
    """Map offsets ``key - query`` to bucket ids: exact for small distances, logarithmic up to ``max_distance``.

    Bidirectional: half the buckets for keys after the query, half for keys at or before it. Causal: every bucket
    for keys at or before the query (later keys are masked anyway and share bucket 0).

    Args:
        relative: the offsets.
        causal: the stack is causal.
        num_buckets: the number of buckets.
        max_distance: distances from this on share the last bucket.

    Returns:
        The bucket ids.

    Shapes: ``relative`` any integer shape -> same shape, long.
    """
    buckets = torch.zeros_like(relative)
    if causal:
        distance = (-relative).clamp(min=0)
    else:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    exact = num_buckets // 2
    # log-spaced buckets from `exact` up to max_distance, then all in the last bucket
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, large)


@register("positional", "t5_relative")
class T5RelativePositionBias(PositionalEncoding):
    """A learned scalar per (bucket of relative position, head) added to the attention scores.

    Computed once per forward pass and shared by every layer of the stack, as in T5. Parameter:
    ``relative_attention_bias`` ``(num_buckets, n_heads)``.

    Args:
        n_heads: heads of the attention it biases.
        causal: the stack is causal (decoder buckets) or bidirectional (encoder buckets).
        num_buckets: relative-position buckets (T5: 32).
        max_distance: distances from this on share the last bucket (T5: 128).

    Raises:
        ValueError: ``num_buckets`` or ``max_distance`` not an integer >= 4.

    Shapes: positions ``(B, Lq)``, ``(B, Lk)`` -> bias ``(B, H, Lq, Lk)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 1,
        d_head: int | None = None,
        max_len: int = 512,
        causal: bool = False,
        num_buckets: int = 32,
        max_distance: int = 128,
    ) -> None:
        super().__init__()
        for name, value in (("num_buckets", num_buckets), ("max_distance", max_distance)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 4:
                raise ValueError(f"t5_relative {name} must be an integer >= 4, got {value!r}")
        self.causal, self.num_buckets, self.max_distance = causal, num_buckets, max_distance
        self.relative_attention_bias = nn.Parameter(torch.empty(num_buckets, n_heads))
        nn.init.normal_(self.relative_attention_bias, std=d_model**-0.5)

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        relative = k_positions[:, None, :] - q_positions[:, :, None]  # (B, Lq, Lk)
        buckets = relative_position_buckets(relative, self.causal, self.num_buckets, self.max_distance)
        return self.relative_attention_bias[buckets].permute(0, 3, 1, 2)  # (B, H, Lq, Lk)
