"""Attention masks — one convention everywhere.

Every mask is boolean with **True = may attend**, broadcastable to ``(B, H, Lq, Lk)``. Masks combine
with ``&``. Causal masks are aligned bottom-right: query ``i`` of ``Lq`` sees keys ``j <= i + Lk - Lq``,
so a query block appended after a KV cache needs no special case. Only attention backends turn masks
into additive floats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import register


def _offsets(lq: int, lk: int, device: torch.device | str | None) -> Tensor:
    """``(Lq, Lk)`` tensor of ``key_index - query_index`` in bottom-right alignment."""
    if lq < 0 or lk < 0:
        raise ValueError(f"sequence lengths must be >= 0, got Lq={lq}, Lk={lk}")
    q = torch.arange(lq, device=device).unsqueeze(-1) + (lk - lq)
    k = torch.arange(lk, device=device).unsqueeze(0)
    return k - q


@register("mask", "causal")
def causal_mask(lq: int, lk: int | None = None, device: torch.device | str | None = None) -> Tensor:
    """Causal mask, bottom-right aligned: query ``i`` may attend key ``j`` iff ``j <= i + Lk - Lq``.

    Args:
        lq: number of queries.
        lk: number of keys (default ``lq``).
        device: where to build the mask.

    Returns:
        The bool mask, True = may attend.

    Shapes: returns ``(Lq, Lk)``.
    """
    lk = lq if lk is None else lk
    return _offsets(lq, lk, device) <= 0


@register("mask", "sliding_window")
def sliding_window_mask(
    lq: int, lk: int | None = None, window: int = 128, device: torch.device | str | None = None
) -> Tensor:
    """Causal mask restricted to the ``window`` most recent keys (the query's own position included).

    Args:
        lq: number of queries.
        lk: number of keys (default ``lq``).
        window: keys each query sees, its own included (>= 1).
        device: where to build the mask.

    Returns:
        The bool mask, True = may attend.

    Shapes: returns ``(Lq, Lk)``.

    Raises:
        ValueError: if ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    lk = lq if lk is None else lk
    off = _offsets(lq, lk, device)
    return (off <= 0) & (off > -window)


@register("mask", "padding")
def padding_mask(key_padding: Tensor) -> Tensor:
    """Key padding mask from a ``(B, Lk)`` bool tensor (True = real token).

    Args:
        key_padding: True where the key is a real token.

    Returns:
        The mask, broadcastable over heads and queries.

    Shapes: ``(B, Lk)`` -> ``(B, 1, 1, Lk)``.

    Raises:
        ValueError: if ``key_padding`` is not a 2-D bool tensor.
    """
    if key_padding.dim() != 2 or key_padding.dtype != torch.bool:
        raise ValueError(
            f"padding mask must be a (B, L) bool tensor, got shape {tuple(key_padding.shape)} "
            f"dtype {key_padding.dtype}"
        )
    return key_padding[:, None, None, :]


@register("mask", "prefix_lm")
def prefix_lm_mask(
    lq: int, lk: int | None = None, prefix_len: int | Tensor = 0, device: torch.device | str | None = None
) -> Tensor:
    """Prefix-LM mask: bidirectional over the first ``prefix_len`` keys, causal after them.

    Args:
        lq: number of queries.
        lk: number of keys (default ``lq``).
        prefix_len: an int, or a ``(B,)`` tensor with one prefix length per row.
        device: where to build the mask.

    Returns:
        The bool mask, True = may attend.

    Raises:
        ValueError: a negative ``prefix_len``, or a ``prefix_len`` tensor that is not 1-D.

    Shapes: returns ``(Lq, Lk)`` for an int prefix, ``(B, 1, Lq, Lk)`` for a tensor.
    """
    lk = lq if lk is None else lk
    causal = causal_mask(lq, lk, device)
    keys = torch.arange(lk, device=device)
    if isinstance(prefix_len, Tensor):
        if prefix_len.dim() != 1:
            raise ValueError(f"prefix_len tensor must be (B,), got shape {tuple(prefix_len.shape)}")
        in_prefix = keys[None, :] < prefix_len.to(keys.device)[:, None]  # (B, Lk)
        return causal[None, None] | in_prefix[:, None, None, :]
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    return causal | (keys < prefix_len)[None, :]


@register("mask", "document")
def document_mask(doc_ids_q: Tensor, doc_ids_k: Tensor | None = None) -> Tensor:
    """Block-diagonal mask for packed sequences: a query attends only keys of its own document.

    Combine with ``causal_mask`` for a packed causal LM.

    Args:
        doc_ids_q: the document id of each query position.
        doc_ids_k: the document id of each key position (default ``doc_ids_q``).

    Returns:
        The bool mask, True where query and key belong to the same document.

    Raises:
        ValueError: ids that are not ``(B, Lq)`` and ``(B, Lk)`` with the same ``B``.

    Shapes: ``(B, Lq)``, ``(B, Lk)`` -> ``(B, 1, Lq, Lk)``.
    """
    doc_ids_k = doc_ids_q if doc_ids_k is None else doc_ids_k
    if doc_ids_q.dim() != 2 or doc_ids_k.dim() != 2 or doc_ids_q.shape[0] != doc_ids_k.shape[0]:
        raise ValueError(
            f"document ids must be (B, Lq) and (B, Lk), got {tuple(doc_ids_q.shape)} "
            f"and {tuple(doc_ids_k.shape)}"
        )
    return (doc_ids_q[:, :, None] == doc_ids_k[:, None, :])[:, None]
