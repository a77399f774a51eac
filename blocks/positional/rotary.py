"""Rotary position embedding (Su et al. 2021, RoFormer): rotate-half (GPT-NeoX, LLaMA) and interleaved (GPT-J) layouts.

Options (through ``options={"positional": {...}}`` in a model config):

- ``base``: θ of the frequencies ``θ^(-2i/d)`` (10000 in the paper; Llama 3 uses 500000);
- ``fraction``: rotate only the first ``int(d_head · fraction)`` dimensions of each head, pass the rest through
  (GPT-NeoX ``rotary_pct``, Phi ``partial_rotary_factor``);
- ``scaling``: frequency scaling for longer contexts:

  - ``{"type": "linear", "factor": f}``: positions divided by f (Chen et al. 2023);
  - ``{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_len"}`` (Llama 3.1: long
    wavelengths divided by ``factor``, short ones kept, a smooth blend between);
  - ``{"type": "yarn", "factor", "original_max_len"}`` with optional ``beta_fast`` (32), ``beta_slow`` (1),
    ``truncate`` (True), and ``attention_factor`` or ``mscale``/``mscale_all_dim`` (YaRN, Peng et al. 2023:
    interpolate the long wavelengths, extrapolate the short ones, a linear ramp between the correction dimensions,
    and cos/sin multiplied by the attention factor ``0.1 ln(factor) + 1``);
  - ``{"type": "longrope", "short_factor", "long_factor", "original_max_len"}`` with optional ``factor`` (default
    ``max_len / original_max_len``) and ``attention_factor`` (default ``sqrt(1 + ln(factor) / ln(original_max_len))``)
    (LongRoPE, Phi-3: per-frequency rescale factors, the long set when a forward pass reaches past
    ``original_max_len`` positions, the short set otherwise, as ``transformers`` switches them).

  The formulas are those of ``transformers``' ``modeling_rope_utils`` (tested against it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..registry import register
from .base import PositionalEncoding

#: Required and optional keys of each scaling type.
SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_len"), ()),
    "yarn": (("factor", "original_max_len"),
             ("beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim")),
    "longrope": (("short_factor", "long_factor", "original_max_len"), ("factor", "attention_factor")),
}
_FLAGS = ("truncate",)
_LISTS = ("short_factor", "long_factor")


@dataclasses.dataclass(frozen=True)
class RotaryScaling:
    """Frequencies of a scaled rotary encoding: ``inv_freq`` (LongRoPE: the short set), LongRoPE's long set and the
    position count past which it applies, and the factor cos and sin are multiplied by.

    Attributes:
        inv_freq: the frequencies ``(dim // 2,)`` (LongRoPE: the short set).
        long_inv_freq: LongRoPE's long set, or None.
        switch_after: the position count past which the long set applies, or None.
        attention_factor: what cos and sin are multiplied by (YaRN, LongRoPE).
    """

    inv_freq: Tensor
    long_inv_freq: Tensor | None = None
    switch_after: int | None = None
    attention_factor: float = 1.0


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension.

    Args:
        x: queries or keys.

    Returns:
        The rotated halves.

    Shapes: ``(..., D)`` -> same.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """``(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)``: the interleaved (GPT-J) layout of ``rotate_half``.

    Args:
        x: queries or keys.

    Returns:
        The rotated pairs.

    Shapes: ``(..., D)`` -> same.
    """
    pairs = x.reshape(*x.shape[:-1], -1, 2)  # (not unflatten: dynamo breaks its graph on Tensor.unflatten)
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def rotary_frequencies(dim: int, base: float, scaling: Mapping[str, Any] | None = None) -> Tensor:
    """``inv_freq_i = base^(-2i/dim)`` for ``i < dim/2``, with optional context-extension scaling, in float32
    (LongRoPE: the short set; see ``rotary_scaling`` for the rest).

    Args:
        dim: the rotated dimensions per head.
        base: θ.
        scaling: the scaling (``{"type": "linear" | "llama3" | "yarn" | "longrope", ...}``), or None.

    Returns:
        The frequencies.

    Shapes: returns ``(dim // 2,)``.

    Raises:
        ValueError: as ``rotary_scaling``.
    """
    return rotary_scaling(dim, base, scaling).inv_freq


def check_scaling(scaling: Mapping[str, Any], dim: int) -> str:
    """The scaling type, after checking its keys and values.

    Args:
        scaling: the scaling dict.
        dim: the rotated dimensions per head (LongRoPE's lists hold ``dim / 2`` factors).

    Returns:
        The scaling's ``type``.

    Raises:
        ValueError: an unknown type, missing or unknown keys, a factor that is not a finite number > 0, a flag that
            is not a bool, or a LongRoPE factor list that is not ``dim / 2`` positive numbers (each named).
    """
    kind = scaling.get("type")
    if kind not in SCALING_KEYS:
        raise ValueError(f"unknown rotary scaling type {kind!r}; expected one of {sorted(SCALING_KEYS)}")
    required, optional = SCALING_KEYS[kind]
    keys = set(scaling) - {"type"}
    if not set(required) <= keys <= set(required) | set(optional):
        raise ValueError(f"rotary scaling {kind!r} takes the keys {list(required)} and optionally "
                         f"{list(optional)}, got {sorted(keys)}")
    for key in keys:
        value = scaling[key]
        if key in _FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"rotary scaling {key} must be True or False, got {value!r}")
        elif key in _LISTS:
            if (not isinstance(value, (list, tuple)) or len(value) != dim // 2
                    or not all(_positive(v) for v in value)):
                raise ValueError(f"rotary scaling {key} must be a list of {dim // 2} finite numbers > 0 (one per "
                                 f"frequency), got {value!r}")
        elif not _positive(value):
            raise ValueError(f"rotary scaling {key} must be a finite number > 0, got {value!r}")
    return kind


def _positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def rotary_scaling(dim: int, base: float, scaling: Mapping[str, Any] | None = None,
                   max_len: int | None = None) -> RotaryScaling:
    """The frequencies (float32) and attention factor of a rotary encoding with optional scaling; ``max_len`` (the
    model's context) gives LongRoPE's default ``factor``.

    Args:
        dim: the rotated dimensions per head.
        base: θ.
        scaling: the scaling dict, or None.
        max_len: the model's context.

    Returns:
        The frequencies and factor.

    Raises:
        ValueError: see ``check_scaling``; llama3 with ``high_freq_factor <= low_freq_factor``.
    """
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if scaling is None:
        return RotaryScaling(inv_freq)
    kind = check_scaling(scaling, dim)
    if kind == "linear":
        return RotaryScaling(inv_freq / scaling["factor"])
    if kind == "yarn":
        return _yarn(inv_freq, dim, base, scaling)
    if kind == "longrope":
        original = int(scaling["original_max_len"])
        factor = scaling.get("factor", (max_len or original) / original)
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short, long = (1.0 / (torch.tensor(scaling[k], dtype=torch.float32) * base**shape)
                       for k in ("short_factor", "long_factor"))
        return RotaryScaling(short, long, original, float(attention))
    # Llama 3.1: wavelengths longer than original_max_len / low_freq_factor are slowed by `factor`, those
    # shorter than original_max_len / high_freq_factor are kept, and the band between is interpolated.
    factor = scaling["factor"]
    low, high, original = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_len"]
    if high <= low:
        raise ValueError(f"rotary llama3 scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return RotaryScaling(torch.where(medium, blended, scaled))


def _yarn(inv_freq: Tensor, dim: int, base: float, scaling: Mapping[str, Any]) -> RotaryScaling:
    """YaRN: interpolated (÷ factor) below the ``beta_slow`` correction dimension, extrapolated (kept) above the
    ``beta_fast`` one, a linear ramp between; cos/sin scaled by the attention factor."""
    factor, original = scaling["factor"], scaling["original_max_len"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast", 32)), correction_dim(scaling.get("beta_slow", 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return RotaryScaling(inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated,
                         attention_factor=float(attention))


@register("positional", "rotary")
class RotaryPositionalEncoding(PositionalEncoding):
    """Rotates each pair of query/key dimensions by an angle proportional to the position, so that
    ``q·k`` depends only on the offset between positions. Angles are computed on the fly in float32 (no table).

    Pairs are ``(i, i + d/2)`` (rotate-half layout, GPT-NeoX/LLaMA); see ``rotary_interleaved`` for ``(2i, 2i+1)``.

    Args:
        d_model: the model's width.
        n_heads: attention heads.
        d_head: width of each head (default ``d_model // n_heads``).
        base: θ of the frequencies.
        fraction: share of each head's dimensions that rotate (the first ``int(d_head · fraction)``).
        scaling: context-extension scaling of the frequencies (see the module docstring), or None.

    Raises:
        ValueError: a base that is not a finite number > 1, a fraction outside (0, 1], an odd rotated width, or a
            bad scaling (see ``check_scaling``).

    Shapes: rotate: x ``(B, H, L, D)``, positions ``(B|1, L)`` -> ``(B, H, L, D)``.
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
        frequencies = rotary_scaling(self.dim, float(base), scaling, max_len)
        self.register_fp32_buffer("inv_freq", frequencies.inv_freq)
        if frequencies.long_inv_freq is not None:
            self.register_fp32_buffer("long_inv_freq", frequencies.long_inv_freq)
        else:
            self.long_inv_freq = None
        self.switch_after = frequencies.switch_after
        self.attention_factor = frequencies.attention_factor

    def _frequencies(self, positions: Tensor) -> Tensor:
        """The frequencies of this forward pass: LongRoPE's long set once it reaches past ``switch_after``
        positions (the whole batch switches, as in ``transformers``), else ``inv_freq``."""
        if self.long_inv_freq is None:
            return self.inv_freq
        return torch.where(positions.max() + 1 > self.switch_after, self.long_inv_freq, self.inv_freq)

    def _cos_sin(self, angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # YaRN / LongRoPE scale cos and sin (so q·k by its square)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def _angles(self, positions: Tensor) -> Tensor:
        angles = positions[..., None].float() * self._frequencies(positions)  # (B, L, dim/2), float32
        return angles[:, None]  # (B, 1, L, dim/2): the angle of each half's element i

    def _rotate_part(self, x: Tensor, angles: Tensor) -> Tensor:
        # x·cos + rotate_half(x)·sin with the halves written out: one pointwise loop for a compiler, where the
        # concatenation of a negated half and a copied half is two more loops, each a barrier between threads.
        cos, sin = self._cos_sin(angles, x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

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
        angles = positions[..., None].float() * self._frequencies(positions)  # (B, L, dim/2)
        return angles.repeat_interleave(2, dim=-1)[:, None]  # (B, 1, L, dim): θ0, θ0, θ1, θ1, ...

    def _rotate_part(self, x: Tensor, angles: Tensor) -> Tensor:
        cos, sin = self._cos_sin(angles, x.dtype)
        return x * cos + rotate_pairs(x) * sin
