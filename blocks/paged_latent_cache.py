"""A paged cache for multi-head latent attention (DeepSeek-V2 §2.1 over PagedAttention's blocks).

Per token, latent attention caches the compressed key/value latent (``kv_lora_rank`` numbers) and the one rotary key
all heads share (``d_rope``) — nothing per head (``blocks.latent_cache`` is the contiguous kind). The paged kind
keeps both side by side in one pool of ``block_size``-position blocks, ``(1, blocks, block_size, r + d_rope)``: a row
of the pool is exactly the key of the absorbed attention (``[c, k_rope]``) and its first ``r`` numbers its value, so
each group of a ``PagedBatch`` is read with one gather (``PagedKVCache``'s) and attends with no further copy.

Block tables, slots, groups and masks are ``PagedKVCache``'s (``blocks.paged_cache``); only the pool's layout and
what attention does with a group differ: ``MultiHeadLatentAttention`` absorbs the up-projections for decode rows and
may expand the latents of a long prefill chunk (its ``absorbs``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .paged_cache import PagedKVCache
from .registry import register


@register("kv_cache", "paged_latent")
class PagedLatentCache(PagedKVCache):
    """One latent-attention layer's paged pool of latents and rotary keys, read and written through the
    ``PagedBatch`` of the current step (``cache.batch``), as ``PagedKVCache``.

    Args:
        n_blocks: blocks the pool may grow to.
        block_size: positions per block.

    Shapes: pool ``(1, blocks, block_size, kv_lora_rank + d_rope)`` (``k``; there is no separate value pool).

    Raises:
        NotImplementedError: a ``dtype`` is given: the latents are kept in the model's dtype.
    """

    def __init__(self, n_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> None:
        if dtype is not None:
            raise NotImplementedError(f"a paged latent cache keeps the model's dtype; got dtype={dtype!r} (a "
                                      "cache dtype of its own is for standard attention's paged cache)")
        super().__init__(n_blocks, block_size)

    @staticmethod
    def numbers_per_position(attention: Any) -> int:
        """Numbers one cached position of one layer takes: ``kv_lora_rank + d_rope``.

        Args:
            attention: the latent-attention module (its ``kv_lora_rank`` and ``d_rope``).

        Returns:
            ``kv_lora_rank + d_rope``.
        """
        return attention.kv_lora_rank + attention.d_rope

    def reserve(self, attention: Any, like: Tensor, blocks: int | None = None) -> None:
        """Allocate the pool of ``blocks`` blocks (default: all ``n_blocks``) now, zeroed, in ``like``'s dtype and
        device.

        Args:
            attention: the latent-attention module (sets the row width).
            like: a tensor whose dtype and device the pool takes.
            blocks: the number of blocks, or None for ``n_blocks``.

        Shapes: like any shape; pool -> ``(1, blocks, block_size, kv_lora_rank + d_rope)``.
        """
        n = self.n_blocks if blocks is None else blocks
        self.k = like.new_zeros((1, n, self.block_size, self.numbers_per_position(attention)))

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds now."""
        return 0 if self.k is None else self.k.nbytes

    def update(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Write the packed new latents ``(1, 1, T, r)`` and rotary keys ``(1, 1, T, d_rope)`` at the batch's slots;
        return them unchanged.

        Args:
            latent: the new tokens' compressed key/value latents.
            k_rope: the new tokens' rotary keys.

        Returns:
            ``(latent, k_rope)``, unchanged.

        Raises:
            ValueError: not one packed row of one latent per token, a row width other than the pool's, or no batch
                set.

        Shapes: latent ``(1, 1, T, r)``, k_rope ``(1, 1, T, d_rope)`` -> the same.
        """
        batch = self._current()
        if latent.shape[:3] != (1, 1, batch.n_tokens) or k_rope.shape[:3] != latent.shape[:3]:
            raise ValueError(f"a paged latent cache takes packed latents (1, 1, T={batch.n_tokens}, r) and rotary keys "
                             f"(1, 1, T, d_rope), got {tuple(latent.shape)} and {tuple(k_rope.shape)}")
        width = latent.shape[-1] + k_rope.shape[-1]
        have = 0 if self.k is None else self.k.shape[1]
        if self.k is not None and self.k.shape[-1] != width:
            raise ValueError(f"this pool holds rows of {self.k.shape[-1]} numbers, got {width}")
        if not torch.compiler.is_compiling() and batch.max_block > have:  # a graph's pool was grown before it runs
            # Zeros, not empty memory: the masked slots of a gathered block are still multiplied (0 · NaN = NaN).
            grown = latent.new_zeros((1, min(self.n_blocks, max(batch.max_block, 2 * have)), self.block_size, width))
            if self.k is not None:
                grown[:, :have] = self.k
            self.k = grown
        pool = self.k.view(-1, width)  # (blocks · block_size, r + d_rope)
        pool[:, : latent.shape[-1]].index_copy_(0, batch.slots, latent[0, 0])
        pool[:, latent.shape[-1]:].index_copy_(0, batch.slots, k_rope[0, 0])
        return latent, k_rope

    def attend(self, q_nope: Tensor, q_rope: Tensor,  # type: ignore[override]
               attend_rows: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """Latent attention of the packed queries over each row's cached latents, group by group.

        Args:
            q_nope: ``(1, H, T, d_nope)`` the queries' non-rotary part.
            q_rope: ``(1, H, T, d_rope)`` the rotated part.
            attend_rows: the module's attention of one group ``(q_nope (G, H, Lq, d_nope), q_rope (G, H, Lq,
                d_rope), keys (G, 1, K, r + d_rope), mask (G, 1, Lq, K)) -> (G, H, Lq, Dv)``; the mask allows each
                query its row's keys at or before its position (True = may attend).

        Returns:
            ``(1, H, T, Dv)``.

        Shapes: q_nope ``(1, H, T, d_nope)``, q_rope ``(1, H, T, d_rope)`` -> ``(1, H, T, Dv)``.
        """
        batch = self._current()
        out = None
        for group in batch.groups:
            keys = self._gather(self.k, group, "k")  # (G, 1, K, r + d_rope)
            mask = group.mask(None, self.block_size)  # (G, 1, Lq, K)
            # (1, H, T, d) -> (G, H, Lq, d): each group row's queries, padded to Lq
            qn, qr = (q[0][:, group.q_index].transpose(0, 1) for q in (q_nope, q_rope))
            og = attend_rows(qn, qr, keys, mask).transpose(0, 1)  # (H, G, Lq, Dv)
            if out is None:
                out = og.new_zeros((og.shape[0], q_nope.shape[2], og.shape[-1]))  # (H, T, Dv)
            out[:, group.flat] = og.flatten(1, 2) if group.dense else og[:, group.valid]
        return out[None]
