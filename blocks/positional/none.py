"""No positional information: attention is permutation-equivariant."""

from __future__ import annotations

from ..registry import register
from .base import PositionalEncoding


@register("positional", "none")
class NoPositionalEncoding(PositionalEncoding):
    """The identity everywhere (for ablations and permutation-equivariance tests)."""

    def __init__(
        self, d_model: int, n_heads: int = 1, d_head: int | None = None, max_len: int = 512, causal: bool = False
    ) -> None:
        super().__init__()
