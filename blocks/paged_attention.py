"""Attention of one-token rows over a paged cache without padding (``RaggedRows``): one *entry* per (row, block) the
row reads, so a row of 20 positions reads 2 blocks of 16 and a row of 380 reads 24, whatever else is in the batch.

Each entry's scores are reduced on their own, as one split of FlashDecoding's split-K (Dao et al. 2023) whose split
is a block: its largest score ``m``, its sum of ``exp(s - m)`` and its ``exp(s - m)``-weighted sum of values. The
entries of a row are then combined with the rescaling of the online softmax (Milakov & Gimelshein 2018): with ``M``
the row's largest ``m``, ``out = Σ exp(m - M) · o / Σ exp(m - M) · l``. Indexing the pools in place, a compiler fuses
each gather into the reductions, so keys and values are read once, in place. Written for ``torch.compile`` (the
engine's runner, ``serving.runner``); eager it is correct but materialises ``(E, Hkv, rep, block_size, D)``
products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .backends.common import additive_mask, soft_cap

__all__ = ["RaggedRows", "ragged_decode_attention"]


@dataclass
class RaggedRows:
    """The one-token rows of a packed batch as entries, one per (row, block read); built by ``PagedBatch``.

    Shapes: ``R`` rows, ``E`` entries, ``W`` the most blocks a row reads.

    Attributes:
        query: ``(R,)`` long, the packed index of each row's query.
        q_pos: ``(R,)`` long, the position of each row's query.
        block: ``(E,)`` long, the block id of each entry.
        row: ``(E,)`` long, the row (0 .. R - 1) of each entry.
        start: ``(E,)`` long, the position of the entry's first slot.
        layout: ``(R, W)`` long, the entry of each row's j-th block; E where the row reads fewer blocks.
        whole: the rows are the whole packed batch, in order (``query`` is ``arange(R)``): no scatter into the output.
    """

    query: Tensor  # (R,) long, the packed index of each row's query
    q_pos: Tensor  # (R,) long, the position of each row's query
    block: Tensor  # (E,) long, the block id of each entry
    row: Tensor  # (E,) long, the row (0 .. R - 1) of each entry
    start: Tensor  # (E,) long, the position of the entry's first slot
    layout: Tensor  # (R, W) long, the entry of each row's j-th block; E where the row reads fewer blocks
    #: the rows are the whole packed batch, in order (``query`` is ``arange(R)``): no scatter into the output
    whole: bool = False


def ragged_decode_attention(k_pool: Tensor, v_pool: Tensor, q: Tensor, rows: RaggedRows, scale: float | None = None,
                            softcap: float | None = None, window: int | None = None,
                            sinks: Tensor | None = None) -> Tensor:
    """Each row's query against its row's keys at or before its position (and within ``window``): the ``math``
    backend's result, per row, by blocks.

    Every row has a key (its own position), so its largest score is finite; an entry whose keys are all masked (out
    of the window) contributes nothing. ``sinks`` ``(H,)`` (gpt-oss) are one more logit per query head in each row's
    softmax, with no value.

    Args:
        k_pool: the key pool of the layer.
        v_pool: the value pool of the layer.
        q: each row's query, its query heads grouped by key/value head.
        rows: the rows' entries (``RaggedRows``).
        scale: the score scale (default ``D ** -0.5``).
        softcap: the soft cap of the scores (``cap · tanh(s / cap)``), or None.
        window: a sliding window: keys fewer than ``window`` positions back only, or None.
        sinks: one extra logit per query head, or None.

    Returns:
        Each row's attention output, in ``q``'s dtype (pools of another dtype are read into it).

    Shapes: pools ``(Hkv, blocks, block_size, D)``, q ``(R, Hkv, rep, D)`` (query head ``h·rep + r`` at ``[:, h,
    r]``) -> ``(R, Hkv, rep, Dv)``.
    """
    heads, _, bs, d = k_pool.shape
    n_rows, _, rep, _ = q.shape
    k = k_pool[:, rows.block].transpose(0, 1).to(q.dtype)  # (E, Hkv, bs, D), left to the compiler to fuse
    scores = (q[rows.row][:, :, :, None, :] * k[:, :, None]).sum(-1).float()  # (E, Hkv, rep, bs)
    scores = soft_cap(scores * (d ** -0.5 if scale is None else scale), softcap)
    distance = rows.q_pos[rows.row][:, None] - (rows.start[:, None] + torch.arange(bs, device=q.device))  # (E, bs)
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    scores = scores + additive_mask(allowed[:, None, None], scores.dtype)
    top = scores.amax(-1)  # (E, Hkv, rep): -inf where every key of the entry is masked
    top = torch.where(torch.isinf(top), 0.0, top)
    weights = torch.exp(scores - top[..., None])
    total = weights.sum(-1)  # (E, Hkv, rep)
    v = v_pool[:, rows.block].transpose(0, 1).to(q.dtype)  # (E, Hkv, bs, Dv)
    values = (weights.to(v.dtype)[..., None] * v[:, :, None]).sum(-2).float()  # (E, Hkv, rep, Dv)
    # Per row: the entries side by side, (R, W, Hkv, rep); a missing entry gets -inf (weight 0).
    present = rows.layout < rows.block.shape[0]
    index = torch.where(present, rows.layout, 0)
    top = top[index] + additive_mask(present, top.dtype)[..., None, None]
    best = top.amax(1)  # (R, Hkv, rep)
    if sinks is not None:
        sink = sinks.float().view(1, heads, rep)
        best = torch.maximum(best, sink)
    scale_by = torch.exp(top - best[:, None])  # (R, W, Hkv, rep)
    denominator = (scale_by * total[index]).sum(1)
    if sinks is not None:
        denominator = denominator + torch.exp(sink - best)
    out = (scale_by[..., None] * values[index]).sum(1) / denominator[..., None]
    return out.to(q.dtype)
