"""Rotary position embedding (Su et al. 2021, RoFormer), in the rotate-half layout (GPT-NeoX, LLaMA)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..registry import register
from .base import PositionalEncoding


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@register("positional", "rotary")
class RotaryPositionalEncoding(PositionalEncoding):
    """Rotates each pair of query/key dimensions by an angle proportional to the position, so that
    ``q·k`` depends only on the offset between positions. Angles are computed on the fly (no table)."""

    rotates = True

    def __init__(
        self, d_model: int, n_heads: int = 1, d_head: int | None = None, max_len: int = 512, base: float = 10000.0
    ) -> None:
        super().__init__()
        d_head = d_model // n_heads if d_head is None else d_head
        if d_head % 2:
            raise ValueError(f"rotary encoding needs an even d_head, got {d_head}")
        inv_freq = 1.0 / base ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        angles = positions[..., None].float() * self.inv_freq  # (B, L, D/2)
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, L, D)
        return (x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)).to(x.dtype)
