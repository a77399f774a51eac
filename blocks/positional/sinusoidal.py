"""Sinusoidal positional encoding (paper §3.5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..registry import register
from .base import PositionalEncoding

LAYOUTS = ("interleave", "concat")


def sinusoid_table(n_positions: int, d_model: int, layout: str = "interleave", base: float = 10000.0) -> Tensor:
    """``PE(pos, 2i) = sin(pos / base^(2i/d))``, ``PE(pos, 2i+1) = cos(pos / base^(2i/d))``.

    ``layout="interleave"`` puts sin on even and cos on odd dimensions, as in the paper;
    ``layout="concat"`` puts all sines first, then all cosines ``[sin | cos]`` (Marian, fairseq).

    Args:
        n_positions: rows of the table.
        d_model: its width (even).
        layout: ``"interleave"`` or ``"concat"``.
        base: the wavelength base (10000 in the paper).

    Returns:
        The table.

    Raises:
        ValueError: an odd ``d_model`` or an unknown layout.

    Shapes: returns ``(n_positions, d_model)`` float32.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sinusoid layout {layout!r}; expected one of {list(LAYOUTS)}")
    if d_model % 2:
        raise ValueError(f"sinusoidal encoding needs an even d_model, got {d_model}")
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(-math.log(base) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = pos * inv_freq  # (P, d/2)
    if layout == "concat":
        table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    else:
        table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # sin, cos, sin, cos, ...
    return table.float()


@register("positional", "sinusoidal")
class SinusoidalPositionalEncoding(PositionalEncoding):
    """Adds fixed sinusoids to the embeddings; the table is a non-persistent buffer extended on demand.

    Args:
        d_model: model width (even).
        max_len: rows precomputed up front; longer inputs extend the table.
        layout: ``"interleave"`` (paper) or ``"concat"`` (``[sin | cos]``).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int = 1,
        d_head: int | None = None,
        max_len: int = 512,
        causal: bool = False,
        layout: str = "interleave",
        base: float = 10000.0,
    ) -> None:
        super().__init__()
        self.d_model, self.layout, self.base = d_model, layout, base
        self.register_fp32_buffer("table", sinusoid_table(max_len, d_model, layout, base))

    def _table(self, n: int) -> Tensor:
        if n > self.table.shape[0]:
            grown = sinusoid_table(max(n, 2 * self.table.shape[0]), self.d_model, self.layout, self.base)
            self._buffers["table"] = grown.to(self.table.device)
        return self.table

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        # Extending the table reads positions; a compiled graph uses the precomputed max_len rows.
        needed = 0 if torch.compiler.is_compiling() or not positions.numel() else int(positions.max()) + 1
        table = self._table(needed)
        return x + table[positions].to(x.dtype)  # (B, L, d_model)


@register("positional", "sinusoidal_concat")
class ConcatSinusoidalPositionalEncoding(SinusoidalPositionalEncoding):
    """Sinusoids in the ``[sin | cos]`` layout, as Marian and fairseq checkpoints use.

    Args:
        d_model: the model's width.
        n_heads: attention heads (unused).
        d_head: width of each head (unused).
        max_len: positions the table holds at first (it extends on demand).
        causal: the stack is causal (unused).

    Shapes: ``(B, L, d_model)`` -> ``(B, L, d_model)``.
    """

    def __init__(
        self, d_model: int, n_heads: int = 1, d_head: int | None = None, max_len: int = 512, causal: bool = False
    ) -> None:
        super().__init__(d_model, n_heads, d_head, max_len, causal, layout="concat")
