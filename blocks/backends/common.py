"""Shared input checks and mask handling for attention backends.

This is the one place where boolean masks become additive floats (``-inf``), and where query rows
with no allowed key are detected so that every backend can return zeros for them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..masks import causal_mask


def check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> None:
    """Validate the backend signature's shapes.

    Args:
        q: the queries.
        k: the keys.
        v: the values.
        mask: bool mask (True = may attend), or None.
        bias: additive float bias, or None.

    Raises:
        ValueError: naming the bad value: tensors that are not 4-D, batch sizes, head dims, heads or lengths that
            differ, mixed dtypes, ``H`` not a multiple of ``Hkv``, a mask or bias that does not broadcast, a mask
            that is not bool.

    Shapes: q ``(B, H, Lq, D)``, k and v ``(B, Hkv, Lk, D)``, mask and bias broadcastable to ``(B, H, Lq, Lk)``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (B, H, L, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, h, _, d = q.shape
    bk, hkv, lk, dk = k.shape
    if bk != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {bk}, v {v.shape[0]}")
    if dk != d:
        raise ValueError(f"q and k head dims differ: {d} vs {dk}")
    if v.shape[1] != hkv or v.shape[2] != lk:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in heads and length")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if hkv < 1 or h % hkv != 0:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads Hkv={hkv}")
    full = (b, h, q.shape[2], lk)
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:
            continue
        # Each dimension 1 or equal to full's, counted from the right (torch.broadcast_shapes goes through its
        # Python reference implementation: ~40 µs a call, per layer and step).
        broadcasts = t.dim() <= 4 and all(s in (1, f) for s, f in zip(reversed(t.shape), reversed(full), strict=False))
        if not broadcasts:
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to (B, H, Lq, Lk)={full}")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True = may attend), got dtype {mask.dtype}")


def check_sinks(sinks: Tensor | None, q: Tensor) -> None:
    """Check that ``sinks`` is None or a floating ``(H,)`` tensor: one logit per query head.

    Args:
        sinks: the sink logits, or None.
        q: the queries (for ``H``).

    Raises:
        ValueError: anything else, naming its shape or type.

    Shapes: sinks ``(H,)``, q ``(B, H, Lq, D)``.
    """
    if sinks is None:
        return
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (q.shape[1],):
        shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a floating tensor of shape (H,)=({q.shape[1]},), one logit per query head; "
                         f"got {shape}")


def sink_scale(lse: Tensor, sinks: Tensor) -> Tensor:
    """``Z / (Z + exp(sink))``: the factor that turns an attention output without sinks into the output with them.

    Args:
        lse: ``log Z``, each query row's log-sum-exp of its scores.
        sinks: each head's sink logit.

    Returns:
        ``sigmoid(lse - sink)`` (exact; 0 where ``Z = 0``).

    Shapes: lse ``(B, H, Lq)``, sinks ``(H,)`` -> ``(B, H, Lq, 1)``.
    """
    return torch.sigmoid(lse.float() - sinks.float()[:, None])[..., None]


def default_scale(q: Tensor, scale: float | None) -> float:
    """``1 / sqrt(d_k)`` (paper §3.2.1) unless ``scale`` is given.

    Args:
        q: the queries (their last dimension is ``d_k``).
        scale: the scale to use instead, or None.

    Returns:
        The scale of the scores.

    Shapes: q ``(B, H, Lq, D)``.
    """
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def soft_cap(scores: Tensor, softcap: float | None) -> Tensor:
    """``softcap · tanh(scores / softcap)`` (Gemma 2): bounds the scores smoothly to (-softcap, softcap).

    Applied to the scaled scores before any bias or mask.

    Args:
        scores: the scaled attention scores.
        softcap: the cap, or None to leave the scores unchanged.

    Returns:
        The capped scores.

    Shapes: ``(...)`` -> same.
    """
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def check_softcap(softcap: float | None) -> None:
    """Check that ``softcap`` is None or a finite positive number.

    Args:
        softcap: the value to check.

    Raises:
        ValueError: anything else (a bool, a string, 0, inf, NaN), naming it.
    """
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf
    ):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def allowed_keys(
    mask: Tensor | None, is_causal: bool, lq: int, lk: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Combine ``mask`` with the causal mask and guard query rows that have no allowed key.

    A softmax over a row of ``-inf`` is NaN. Rows with no allowed key are opened up here, which keeps every
    backend (and its gradient) finite, and ``has_key`` (``(..., Lq, 1)`` bool) lets the caller zero those
    rows afterwards. The guard is unconditional tensor algebra (no data-dependent branch), so it traces
    under ``torch.compile(fullgraph=True)``.

    Args:
        mask: bool mask (True = may attend), or None.
        is_causal: add the bottom-right aligned causal mask.
        lq: number of queries.
        lk: number of keys.
        device: where to build the causal mask.

    Shapes: mask broadcastable to ``(B, H, Lq, Lk)`` -> allowed of the broadcast shape, has_key ``(..., Lq, 1)``.

    Returns:
        ``(allowed, has_key)``: ``allowed`` is None when nothing is masked; ``has_key`` is None when no
        row can be empty (no mask, or only a causal mask with ``Lq <= Lk``).
    """
    if is_causal and lq > 1:  # (a single query sees every key under the bottom-right causal mask)
        causal = causal_mask(lq, lk, device=device)
        if mask is None and lq <= lk:
            return causal, None
        mask = causal if mask is None else mask & causal
    if mask is None:
        return None, None
    has_key = mask.any(dim=-1, keepdim=True)
    return mask | ~has_key, has_key


def zero_empty_rows(out: Tensor, has_key: Tensor | None) -> Tensor:
    """Zero the output rows whose queries had no allowed key.

    Args:
        out: the attention output.
        has_key: from ``allowed_keys``, or None (no row can be empty).

    Returns:
        ``out`` with those rows zero.

    Shapes: out ``(B, H, Lq, D)``, has_key broadcastable to ``(B, H, Lq, 1)`` -> ``(B, H, Lq, D)``.
    """
    if has_key is None:
        return out
    return out * has_key.to(out.dtype)


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = may attend) -> additive float mask (0 or -inf). The only ``-inf`` in the zoo.

    Args:
        mask: the bool mask.
        dtype: the float dtype of the result.

    Returns:
        0 where the mask is True, ``-inf`` elsewhere.

    Shapes: ``(...)`` -> same.
    """
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Repeat key/value heads for grouped-query attention.

    Args:
        x: keys or values.
        n_rep: query heads per key/value head.

    Returns:
        ``x`` with each head repeated ``n_rep`` times (``x`` itself when ``n_rep == 1``).

    Shapes: ``(B, Hkv, L, D)`` -> ``(B, Hkv * n_rep, L, D)``, head ``h`` of the output is head
    ``h // n_rep`` of the input.
    """
    if n_rep == 1:
        return x
    b, hkv, length, d = x.shape
    return x[:, :, None].expand(b, hkv, n_rep, length, d).reshape(b, hkv * n_rep, length, d)
