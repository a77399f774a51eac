"""Key/value caches for incremental decoding."""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import get, register


@register("kv_cache", "contiguous")
class KVCache:
    """A preallocated per-layer cache of keys and values, written in place.

    The buffers ``(B, Hkv, max_len, D)`` are allocated on the first ``update`` (when shapes, dtype and
    device are known); later steps copy the new keys/values into the next free slots, so past positions
    are never recomputed or re-concatenated.

    Args:
        max_len: number of positions to preallocate (prompt + new tokens).

    Raises:
        ValueError: ``max_len`` below 1.
    """

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.length = 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new keys and values and return all cached so far.

        Args:
            k: the new positions' keys.
            v: their values.

        Returns:
            ``(keys, values)``: views of every cached position, the new ones included.

        Raises:
            ValueError: the new positions would overflow ``max_len``.

        Shapes: k, v ``(B, Hkv, L, D)`` -> ``(B, Hkv, length, D)`` each.
        """
        if self.k is None:
            b, h, _, d = k.shape
            self.k = k.new_empty((b, h, self.max_len, d))
            self.v = v.new_empty((b, h, self.max_len, v.shape[-1]))
        new = k.shape[2]
        if self.length + new > self.max_len:
            raise ValueError(
                f"KV cache overflow: {self.length} cached + {new} new positions > max_len={self.max_len}"
            )
        self.k[:, :, self.length : self.length + new] = k
        self.v[:, :, self.length : self.length + new] = v
        self.length += new
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows ``index`` (beam search); only the filled positions are moved, in place when
        the batch size is unchanged.

        Args:
            index: the rows to keep, in their new order.

        Shapes: index ``(B',)`` long.
        """
        if self.k is None:
            return
        filled = slice(0, self.length)
        if index.numel() == self.k.shape[0]:
            self.k[:, :, filled] = self.k[:, :, filled].index_select(0, index)
            self.v[:, :, filled] = self.v[:, :, filled].index_select(0, index)
        else:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)


class StaticKVCache:
    """Keys/values computed once and reused at every step (cross-attention over encoder memory)."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def filled(self) -> bool:
        return self.k is not None

    def set(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the keys and values (computed once from the encoder memory).

        Args:
            k: the keys.
            v: the values.

        Returns:
            ``(k, v)``.

        Shapes: k, v ``(B, Hkv, S, D)``.
        """
        self.k, self.v = k, v
        return k, v

    def reorder(self, index: Tensor) -> None:
        """Select batch rows ``index`` (beam search).

        Args:
            index: the rows to keep, in their new order.

        Shapes: index ``(B',)`` long.
        """
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)


class LayerCache:
    """The caches of one decoder layer: self-attention (a registered ``kv_cache`` kind, ``"contiguous"`` by default;
    ``"latent"`` for latent attention) and (for encoder-decoders) cross-attention.

    Args:
        max_len: positions the self-attention cache holds.
        cross: add a cross-attention cache (encoder-decoders).
        kind: registered ``kv_cache`` name of the self-attention cache.
    """

    def __init__(self, max_len: int, cross: bool = False, kind: str = "contiguous") -> None:
        self.self_attn = get("kv_cache", kind)(max_len)
        self.cross_attn = StaticKVCache() if cross else None

    def reorder(self, index: Tensor) -> None:
        """Select batch rows ``index`` in both caches (beam search).

        Args:
            index: the rows to keep, in their new order.

        Shapes: index ``(B',)`` long.
        """
        self.self_attn.reorder(index)
        if self.cross_attn is not None:
            self.cross_attn.reorder(index)


def reorder_caches(caches: list[LayerCache], index: Tensor) -> None:
    """Reorder every layer cache along the batch dimension (beam search).

    Args:
        caches: one ``LayerCache`` per layer.
        index: the rows to keep, in their new order.

    Shapes: index ``(B',)``.
    """
    index = index.to(torch.long)
    for cache in caches:
        cache.reorder(index)


class BucketKVCache:
    """A fixed-shape self-attention cache for compiled decoding: every step has the same shapes.

    The buffers hold ``bucket`` positions; ``length`` always reports ``bucket - 1`` so that a one-token step sees
    ``bucket`` keys, and a ``(B, bucket)`` padding mask (True = written, real slot, the current one included) hides
    the slots not written yet. New keys/values are written at the slot held in the long tensor ``index``: the
    caller moves it (in place) between steps, so neither the write position nor any shape is a Python number
    that a compiled graph would specialise on — one graph serves every step and every prompt length of the bucket.

    Args:
        k: the keys' ``(B, Hkv, bucket, D)`` buffer (written in place).
        v: the values' ``(B, Hkv, bucket, D)`` buffer (written in place).
        index: ``(1,)`` long, the slot of the next write (shared by all layers).

    Raises:
        ValueError: buffers of different shapes, or an index that is not a ``(1,)`` long tensor.

    Shapes: k, v ``(B, Hkv, bucket, D)``, index ``(1,)``.
    """

    def __init__(self, k: Tensor, v: Tensor, index: Tensor) -> None:
        if k.shape[:3] != v.shape[:3] or index.shape != (1,) or index.dtype != torch.long:
            raise ValueError(
                f"BucketKVCache needs k, v (B, Hkv, bucket, D) of one shape and a (1,) long index, got "
                f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(index.shape)} {index.dtype}"
            )
        self.k, self.v, self.index = k, v, index

    @property
    def length(self) -> int:
        return self.k.shape[2] - 1

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one position at ``index``; return the whole buffers.

        Args:
            k: the new position's keys.
            v: its values.

        Returns:
            ``(keys, values)``: the whole buffers.

        Shapes: k, v ``(B, Hkv, 1, D)`` -> ``(B, Hkv, bucket, D)`` each.
        """
        self.k.index_copy_(2, self.index, k)
        self.v.index_copy_(2, self.index, v)
        return self.k, self.v
