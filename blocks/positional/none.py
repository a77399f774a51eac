"""No positional information: attention is permutation-equivariant."""

from __future__ import annotations

from ..registry import register
from .base import PositionalEncoding


@register("positional", "none")
class NoPositionalEncoding(PositionalEncoding):
    """The identity everywhere (for ablations and permutation-equivariance tests).

    It takes the model's shape, as every positional encoding does, and uses none of it.

    Args:
        d_model: the model's width.
        n_heads: attention heads.
        d_head: width of each head.
        max_len: the longest sequence.
        causal: the stack is causal.
    """

    def __init__(
        self, d_model: int, n_heads: int = 1, d_head: int | None = None, max_len: int = 512, causal: bool = False
    ) -> None:
        super().__init__()
