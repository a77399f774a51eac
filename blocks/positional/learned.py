"""Learned absolute position embeddings (BERT, GPT-2; paper Table 3 row E)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..registry import register
from .base import PositionalEncoding


@register("positional", "learned")
class LearnedPositionalEmbedding(PositionalEncoding):
    """A ``(max_len, d_model)`` embedding table added to the token embeddings; cannot extend.

    Args:
        d_model: the model's width.
        n_heads: attention heads.
        d_head: width of each head.
        max_len: the longest sequence.
        causal: the stack is causal.

    Shapes: ``(B, L, d_model)`` -> ``(B, L, d_model)``.
    """

    def __init__(
        self, d_model: int, n_heads: int = 1, d_head: int | None = None, max_len: int = 512, causal: bool = False
    ) -> None:
        super().__init__()
        self.max_positions = max_len
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        self.check_positions(positions)
        return x + self.weight[positions]  # (B, L, d_model)
