"""RoPE settings in GGUF metadata: ``rope_scaling`` from the ``<arch>.rope.scaling.*`` keys, and Llama 3.1's scaling
recovered from (and written as) llama.cpp's ``rope_freqs`` tensor of per-frequency divisors."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from torch import Tensor

from .file import number, size


def rope_scaling_from_metadata(metadata: Mapping[str, Any], arch: str = "llama") -> dict[str, Any] | None:
    """``rope_scaling`` from the ``<arch>.rope.scaling.*`` keys (``rope.scale_linear`` in older files).

    Args:
        metadata: the file's metadata.
        arch: the architecture prefix of the keys.

    Returns:
        The ``transformers`` ``rope_scaling`` dict, or None without scaling.

    Raises:
        ValueError: a scaling type that is not a string, a type without its factor, or a factor or YaRN value that
            is not a finite positive number (each named with its key).
    """
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor_key = f"{arch}.rope.scaling.factor"
    if kind is None and metadata.get(f"{arch}.rope.scale_linear") not in (None, 1.0):
        kind, factor_key = "linear", f"{arch}.rope.scale_linear"
    if kind in (None, "none"):
        return None
    if not isinstance(kind, str):
        raise ValueError(f"GGUF metadata {arch}.rope.scaling.type={kind!r}: expected a string")
    if factor_key not in metadata:
        raise ValueError(f"{arch}.rope.scaling.type={kind!r} without {arch}.rope.scaling.factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": number(metadata, factor_key, None)}
    if kind == "linear":
        return scaling
    # Any other type is passed on with what the file states; the converter refuses types it cannot compute.
    extra = {
        "original_context_length": ("original_max_position_embeddings", size),
        "attn_factor": ("attention_factor", number),
        "yarn_beta_fast": ("beta_fast", number),
        "yarn_beta_slow": ("beta_slow", number),
    }
    for suffix, (name, check) in extra.items():
        if f"{arch}.rope.scaling.{suffix}" in metadata:
            scaling[name] = check(metadata, f"{arch}.rope.scaling.{suffix}", None)
    return scaling


def add_llama3_rope_scaling(config: dict[str, Any], factors: Tensor) -> None:
    """Recover Llama 3.1's ``rope_scaling`` from llama.cpp's ``rope_freqs`` divisors (in place).

    llama.cpp's converter writes, for each rotary frequency of wavelength ``w``, the divisor 1 where
    ``w < L / high``, ``factor`` where ``w > L / low``, and ``1 / ((1 - s) / factor + s)`` between, with
    ``s = (L / w - low) / (high - low)`` (as transformers' ``_compute_llama3_parameters``). ``s`` is affine in
    ``1 / w``: the divisors fix ``factor`` and that line, not ``L``, ``low`` and ``high`` one by one, so
    ``low_freq_factor`` is set to 1. Whatever the parameters, they are kept only if they reproduce every divisor.

    Args:
        config: the ``transformers`` config dict being built (changed in place).
        factors: the ``rope_freqs`` tensor's divisors.

    Shapes: factors ``(d_rotary / 2,)``.

    Raises:
        ValueError: the file also states a rope scaling type, or the divisors are not llama3's.
    """
    divisors = factors.double().tolist()
    if not all(0 < d < math.inf for d in divisors):
        raise ValueError(f"the GGUF rope_freqs tensor holds divisors that are not finite and positive: {divisors[:8]}")
    if all(d == 1.0 for d in divisors):
        return  # frequencies unchanged
    if "rope_scaling" in config:
        raise ValueError(
            f"the GGUF file has both rope_scaling {config['rope_scaling']} and a rope_freqs tensor; "
            "a llama config holds one rope scaling"
        )
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    inv_wavelen = [1 / (2 * math.pi * config["rope_theta"] ** (2 * i / head_dim)) for i in range(head_dim // 2)]
    factor = max(divisors)
    not_llama3 = ValueError(f"the GGUF rope_freqs tensor {[round(d, 4) for d in divisors]} is not llama3 rope scaling")
    if factor <= 1.0:
        raise not_llama3
    high = [u for u, d in zip(inv_wavelen, divisors, strict=True) if math.isclose(d, 1.0, rel_tol=1e-6)]
    low = [u for u, d in zip(inv_wavelen, divisors, strict=True) if math.isclose(d, factor, rel_tol=1e-6)]
    medium = [(u, (1 / d - 1 / factor) / (1 - 1 / factor)) for u, d in zip(inv_wavelen, divisors, strict=True)
              if u not in high and u not in low]
    # The line s = a * u - b (u = 1 / w, a = L / (high - low), b = low / (high - low)): s > 1 on the high
    # frequencies, s < 0 on the low ones. Two medium points fix it; with fewer, the missing ones are put on
    # the boundaries halfway between the groups, which reproduces the divisors just as well.
    if len(medium) < 2:
        top = min(high) if high else 2 * max(inv_wavelen)
        bottom = max(low)
        if medium:
            medium.append(((medium[0][0] + top) / 2, 1.0))
        else:
            medium = [(bottom + (top - bottom) / 3, 0.0), (bottom + 2 * (top - bottom) / 3, 1.0)]
    u = np.array([m[0] for m in medium])
    a, neg_b = np.linalg.lstsq(np.stack([u, np.ones_like(u)], 1), np.array([m[1] for m in medium]), rcond=None)[0]
    a, b = float(a), -float(neg_b)
    if not (a > 0 and b > 0):
        raise not_llama3
    # Readable numbers first (Llama 3.1: 8192, 1, 4), the unrounded ones if those do not reproduce the file.
    for original, high_factor in ((round(a / b), 1.0 + round(1 / b, 4)), (a / b, 1.0 + 1 / b)):
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": high_factor, "original_max_position_embeddings": original}
        rebuilt = llama3_divisors(inv_wavelen, scaling)
        if all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(rebuilt, divisors, strict=True)):
            config["rope_scaling"] = scaling
            return
    raise not_llama3


def llama3_divisors(inv_wavelen: list[float], scaling: Mapping[str, Any]) -> list[float]:
    """llama.cpp's ``rope_freqs`` for these llama3 parameters (``convert_hf_to_gguf.LlamaModel``).

    Args:
        inv_wavelen: ``1 / wavelength`` of each rotary frequency.
        scaling: the llama3 ``rope_scaling``.

    Returns:
        One divisor per frequency.
    """
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for u in inv_wavelen:
        if 1 / u < original / high:
            out.append(1.0)
        elif 1 / u > original / low:
            out.append(factor)
        else:
            s = (original * u - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return out
