"""Rotary position embedding (Su et al. 2021, RoFormer): rotate-half (GPT-NeoX, LLaMA) and interleaved (GPT-J) layouts.

Options (through ``options={"positional": {...}}`` in a model config):

- ``base``: θ of the frequencies ``θ^(-2i/d)`` (10000 in the paper; Llama 3 uses 500000);
- ``fraction``: rotate only the first ``int(d_head · fraction)`` dimensions of each head, pass the rest through
  (GPT-NeoX ``rotary_pct``, Phi ``partial_rotary_factor``);
- ``scaling``: frequency scaling for longer contexts, ``{"type": "linear", "factor": f}`` (positions divided by f,
  Chen et al. 2023) or ``{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
  "original_max_len"}`` (Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend
  between).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..registry import register
from .base import PositionalEncoding

SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"),
}


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``: the interleaved (GPT-J) layout of ``rotate_half``."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def rotary_frequencies(dim: int, base: float, scaling: Mapping[str, Any] | None = None) -> Tensor:
    """``inv_freq_i = base^(-2i/dim)`` for ``i < dim/2``, with optional context-extension scaling, in float32.

    Shapes: returns ``(dim // 2,)``.

    Raises:
        ValueError: an unknown scaling type, missing or extra scaling keys, or non-positive factors.
    """
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if scaling is None:
        return inv_freq
    kind = scaling.get("type")
    if kind not in SCALING_KEYS:
        raise ValueError(f"unknown rotary scaling type {kind!r}; expected one of {sorted(SCALING_KEYS)}")
    keys = set(scaling) - {"type"}
    if keys != set(SCALING_KEYS[kind]):
        raise ValueError(f"rotary scaling {kind!r} takes the keys {list(SCALING_KEYS[kind])}, got {sorted(keys)}")
    for key in keys:
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"rotary scaling {key} must be a finite number > 0, got {value!r}")
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    # Llama 3.1: wavelengths longer than original_max_len / low_freq_factor are slowed by `factor`, those
    # shorter than original_max_len / high_freq_factor are kept, and the band between is interpolated.
    low, high, original = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_len"]
    if high <= low:
        raise ValueError(f"rotary llama3 scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, scaled)


@register("positional", "rotary")
class RotaryPositionalEncoding(PositionalEncoding):
    """Rotates each pair of query/key dimensions by an angle proportional to the position, so that
    ``q·k`` depends only on the offset between positions. Angles are computed on the fly in float32 (no table).

    Pairs are ``(i, i + d/2)`` (rotate-half layout, GPT-NeoX/LLaMA); see ``rotary_interleaved`` for ``(2i, 2i+1)``.

    Args:
        d_model, n_heads, d_head: the model's shape (``d_head`` defaults to ``d_model // n_heads``).
        base: θ of the frequencies.
        fraction: share of each head's dimensions that rotate (the first ``int(d_head · fraction)``).
        scaling: context-extension scaling of the frequencies (see the module docstring), or None.
    """

    rotates = True

    def __init__(
        self,
        d_model: int,
        n_heads: int = 1,
        d_head: int | None = None,
        max_len: int = 512,
        causal: bool = False,
        base: float = 10000.0,
        fraction: float = 1.0,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        d_head = d_model // n_heads if d_head is None else d_head
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base < math.inf:
            raise ValueError(f"rotary base must be a finite number > 1, got {base!r}")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"rotary fraction must be in (0, 1], got {fraction!r}")
        self.dim = int(d_head * fraction)
        if self.dim < 2 or self.dim % 2:
            raise ValueError(
                f"rotary encoding needs an even number >= 2 of rotated dimensions, got {self.dim} "
                f"(d_head={d_head}, fraction={fraction})"
            )
        self.register_fp32_buffer("inv_freq", rotary_frequencies(self.dim, float(base), scaling))

    def _angles(self, positions: Tensor) -> Tensor:
        angles = positions[..., None].float() * self.inv_freq  # (B, L, dim/2), float32
        return torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, L, dim)

    def _rotate_part(self, x: Tensor, angles: Tensor) -> Tensor:
        return x * angles.cos().to(x.dtype) + rotate_half(x) * angles.sin().to(x.dtype)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        angles = self._angles(positions)
        if self.dim == x.shape[-1]:
            return self._rotate_part(x, angles).to(x.dtype)
        rotated, passed = x[..., : self.dim], x[..., self.dim :]
        return torch.cat([self._rotate_part(rotated, angles), passed], dim=-1).to(x.dtype)


@register("positional", "rotary_interleaved")
class InterleavedRotaryPositionalEncoding(RotaryPositionalEncoding):
    """Rotary encoding with pairs ``(2i, 2i+1)`` (GPT-J, the RoFormer paper's own layout, llama.cpp's storage)."""

    def _angles(self, positions: Tensor) -> Tensor:
        angles = positions[..., None].float() * self.inv_freq  # (B, L, dim/2)
        return angles.repeat_interleave(2, dim=-1)[:, None]  # (B, 1, L, dim): θ0, θ0, θ1, θ1, ...

    def _rotate_part(self, x: Tensor, angles: Tensor) -> Tensor:
        return x * angles.cos().to(x.dtype) + rotate_pairs(x) * angles.sin().to(x.dtype)
