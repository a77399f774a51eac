"""A paged key/value cache (Kwon et al. 2023, "PagedAttention", §4.1–4.3): fixed-size blocks, per-request block
tables, a block allocator with reference counts, a free list and a prefix cache with LRU eviction
(``blocks.block_allocator``, re-exported here).

Keys and values live in one pool per layer of ``block_size``-position blocks; a request owns the blocks its tokens
fill (its *block table*), so the memory in use follows the tokens in use, not batch × maximum length. The pool
itself grows (doubling) up to ``n_blocks`` as higher block ids are first written; the allocator hands out the
lowest free ids, so a lightly loaded cache stays small.

A batch over the cache is **packed** (flattened tokens): the new tokens of every row — a prefill chunk or one
decode token — are concatenated into one sequence ``(1, T)``, so the projections and the FFN run on ``T`` real
tokens with no padding. ``PagedBatch`` (``blocks.paged_batch``) records where each row's queries sit, the cache
slot each new key/value is written to, and which blocks each row reads. Attention (``PagedKVCache.attend``)
gathers each row's keys from its blocks and calls the module's backend on rows padded to the longest query of their
group: decode rows (one query) form groups by context length and prefill rows another, so a long prefill chunk does
not pad every decode row to its length. Compiled, decode rows attend without padding instead, reading their blocks in
place (``blocks.paged_attention``, a batch built with ``decode="ragged"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .block_allocator import BlockAllocator
from .paged_attention import RaggedRows, ragged_decode_attention
from .paged_batch import GROUP_COST, AttentionGroup, PagedBatch, split_by_length
from .registry import get, register

__all__ = ["GROUP_COST", "BlockAllocator", "PagedBatch", "PagedKVCache", "PagedLayerCache", "RaggedRows",
           "ragged_decode_attention", "split_by_length"]


@register("kv_cache", "paged")
class PagedKVCache:
    """One layer's paged key/value pool, read and written through the ``PagedBatch`` of the current step.

    ``MultiHeadAttention`` calls ``update`` with the packed new keys/values (written at ``batch.slots``), then
    ``attend`` with the packed queries instead of its backend. ``length`` is 0: positions come from the batch,
    not from a contiguous prefix.

    The pools are head-major, ``(Hkv, blocks, block_size, D)``: viewed as ``(Hkv·blocks, block_size·D)``, a group's
    blocks are gathered with one ``index_select`` of whole rows into ``(G, Hkv, K, D)``, each key/value head's keys a
    contiguous ``(K, D)`` matrix; the query heads sharing a key/value head (GQA) are folded into the query length, so
    the keys need no second copy.

    The pools may hold another float dtype than the model computes in (``dtype``: float16 keys and values under a
    float32 model, as llama.cpp's default cache and vLLM's ``kv_cache_dtype``): new keys and values are rounded to it
    when written, and read back into the queries' dtype, so attention still computes in the model's.

    Args:
        n_blocks: blocks the pool may grow to.
        block_size: positions per block.
        dtype: the pools' float dtype, or None for the dtype of the first keys written (the model's).

    Shapes: pools ``(Hkv, blocks, block_size, D)``.

    Raises:
        ValueError: ``n_blocks`` or ``block_size`` is not a positive integer, or ``dtype`` is not a float dtype.
    """

    length = 0

    def __init__(self, n_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> None:
        for name, value in (("n_blocks", n_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"a paged cache's dtype must be a float torch.dtype or None, got {dtype!r}")
        self.n_blocks, self.block_size, self.dtype = n_blocks, block_size, dtype
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.batch: PagedBatch | None = None
        #: reused gather buffers by name; the engine's runner shares one dict among its layers (each layer's gathers
        #: are consumed before the next layer's): fresh multi-megabyte buffers every layer cost page faults.
        self.workspace: dict[str, Tensor] = {}
        #: ``ragged_decode_attention`` compiled, set by a caller that compiles it (the engine's runner): eager steps
        #: attend their ``RaggedRows`` through it (uncompiled it is correct but slow).
        self.ragged_attention: Callable[..., Tensor] | None = None

    @staticmethod
    def numbers_per_position(attention: Any) -> int:
        """Numbers one cached position of one layer takes: keys and values of every key/value head.

        Args:
            attention: the attention module (its ``n_kv_heads``, ``d_head``, ``d_value``).

        Returns:
            ``n_kv_heads · (d_head + d_value)``.
        """
        return attention.n_kv_heads * (attention.d_head + attention.d_value)

    def reserve(self, attention: Any, like: Tensor, blocks: int | None = None) -> None:
        """Allocate the pools of ``blocks`` blocks (default: all ``n_blocks``) now, zeroed, in the cache's ``dtype``
        (else ``like``'s) on ``like``'s device (what they held is dropped: ``grow`` keeps it).

        Args:
            attention: the layer's attention module (its ``n_kv_heads``, ``d_head`` and ``d_value``).
            like: a tensor of the model's float dtype and the pools' device.
            blocks: the blocks to allocate, or None for ``n_blocks``.

        Shapes: pools ``(Hkv, blocks, block_size, D)`` (values ``D = d_value``).
        """
        n, dtype = self.n_blocks if blocks is None else blocks, self.dtype or like.dtype
        self.k = like.new_zeros((attention.n_kv_heads, n, self.block_size, attention.d_head), dtype=dtype)
        self.v = like.new_zeros((attention.n_kv_heads, n, self.block_size, attention.d_value), dtype=dtype)

    def grow(self, attention: Any, like: Tensor, needed: int) -> None:
        """Make the pools hold at least ``needed`` blocks (doubling, at most ``n_blocks``), their contents kept, the
        new blocks zeroed: what a compiled step calls between steps, since a graph never grows a pool (it takes the
        pools as inputs whose block count is dynamic).

        Args:
            attention: the layer's attention module (its key/value head count and head sizes).
            like: a tensor of the model's float dtype and the pools' device.
            needed: blocks the pools must hold.

        Shapes: pools ``(Hkv, blocks, block_size, D)``.
        """
        have = 0 if self.k is None else self.k.shape[1]
        if needed <= have:
            return
        old = (self.k, self.v)
        self.reserve(attention, like, min(self.n_blocks, max(needed, 2 * have)))
        for pool, before in zip((self.k, self.v), old, strict=True):
            if before is not None:
                pool[:, :have] = before

    def scrub(self, blocks: Tensor) -> None:
        """Zero ``blocks`` (long ids) in the pools (what a failed request wrote must not be read again).

        Args:
            blocks: the block ids (ids past the pool's size are skipped).

        Shapes: blocks ``(n,)`` long.
        """
        for pool in (self.k, self.v):
            if pool is not None:
                pool.index_fill_(1, blocks[blocks < pool.shape[1]], 0.0)

    @property
    def nbytes(self) -> int:
        """Bytes the pools hold now."""
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def block_nbytes(self) -> int:
        """Bytes of one block (keys and values), 0 before the first write.

        Returns:
            The byte count.
        """
        return 0 if self.k is None else self.nbytes // self.k.shape[1]

    def _grow(self, k: Tensor, v: Tensor, needed: int) -> None:
        have = 0 if self.k is None else self.k.shape[1]
        if needed <= have:
            return
        size = min(self.n_blocks, max(needed, 2 * have))
        # The old blocks copied, the new ones zeroed (not left as they come: the masked slots of a gathered block
        # are still multiplied, and 0 · NaN = NaN); each part written once.
        grown_k = k.new_empty((k.shape[1], size, self.block_size, k.shape[-1]), dtype=self.dtype or k.dtype)
        grown_v = v.new_empty((v.shape[1], size, self.block_size, v.shape[-1]), dtype=self.dtype or v.dtype)
        for grown, old in ((grown_k, self.k), (grown_v, self.v)):
            if old is not None:
                grown[:, :have] = old
            grown[:, have:].zero_()
        self.k, self.v = grown_k, grown_v

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the packed new keys/values at the batch's slots, in the pools' dtype (growing the pools first when
        a slot lies beyond them, outside a compiled graph); return them unchanged.

        Args:
            k: the new keys of every row of the batch, packed along the token axis.
            v: the new values, packed the same way.

        Returns:
            ``(k, v)`` as given: attention reads the cache through ``attend``, not through these.

        Raises:
            ValueError: no ``PagedBatch`` is set, or ``k`` is not packed as ``(1, Hkv, T, D)`` with the batch's
                ``T`` (checked outside a compiled graph).

        Shapes: k ``(1, Hkv, T, D)``, v ``(1, Hkv, T, Dv)`` -> the same.
        """
        batch = self._current()
        # (skipped while compiling: reading the int would specialise a graph with dynamic shapes to one size)
        if not torch.compiler.is_compiling() and (k.shape[0] != 1 or k.shape[2] != batch.n_tokens):
            raise ValueError(
                f"a paged cache takes packed keys (1, Hkv, T={batch.n_tokens}, D), got {tuple(k.shape)}"
            )
        if not torch.compiler.is_compiling():  # a graph's pools were grown before it runs (``grow``)
            self._grow(k, v, batch.max_block)
        self.k.view(self.k.shape[0], -1, self.k.shape[-1]).index_copy_(1, batch.slots, k[0].to(self.k.dtype))
        self.v.view(self.v.shape[0], -1, self.v.shape[-1]).index_copy_(1, batch.slots, v[0].to(self.v.dtype))
        return k, v

    def attend(
        self, q: Tensor, backend: Callable[..., Tensor], *, scale: float | None = None,
        softcap: float | None = None, window: int | None = None, sinks: Tensor | None = None,
    ) -> Tensor:
        """Attention of the packed queries ``(1, H, T, D)`` over each row's cached keys, through ``backend``.

        Each query at position ``p`` sees its row's keys at positions ``<= p`` (and ``> p - window`` with a
        sliding window). A group of one-token rows puts the query heads of a key/value head along the query axis,
        ``(G, Hkv, rep·Lq, D)``, so GQA needs no copy of the keys and the mask broadcasts over the key/value heads;
        ``sinks`` ``(H,)`` (gpt-oss) then become one more key per group, a zero key and value whose additive bias is
        each query row's sink. A row of several new tokens (a prefill chunk) attends alone, ``(1, H, Lq, D)``, over
        its own keys with the bottom-right causal mask (``is_causal``: no mask to build and check per layer).
        A batch's ``RaggedRows`` (one-token rows, ``decode="ragged"``) attend through ``ragged_decode_attention``
        (``ragged_attention`` when set, outside a compiled graph).

        Args:
            q: the packed queries of every row of the batch.
            backend: the attention backend (the DESIGN signature), called per group.
            scale: the score scale, or None for ``1 / sqrt(D)``.
            softcap: the logit soft cap (Gemma 2), or None.
            window: the sliding window in positions, or None for full causal attention.
            sinks: one sink logit per query head (gpt-oss), or None.

        Returns:
            The attention output of every packed query.

        Raises:
            ValueError: no ``PagedBatch`` is set (``cache.batch``).

        Shapes: q ``(1, H, T, D)``, sinks ``(H,)`` -> ``(1, H, T, Dv)``.
        """
        batch = self._current()
        n_heads, n_kv = q.shape[1], self.k.shape[0]
        rep = n_heads // n_kv
        ragged = batch.ragged
        if ragged is not None:  # one-token rows without padding (blocks/paged_attention.py)
            compiling = torch.compiler.is_compiling()
            attention = ragged_decode_attention if compiling or self.ragged_attention is None else \
                self.ragged_attention
            qr = (q[0] if ragged.whole else q[0][:, ragged.query]).view(n_kv, rep, -1, q.shape[-1])
            qr = qr.permute(2, 0, 1, 3)  # (R, Hkv, rep, D)
            # Outside a graph, standard strides: a one-row view's strides differ and would compile a second graph.
            qr = qr if compiling else qr.clone(memory_format=torch.contiguous_format)
            og = attention(self.k, self.v, qr, ragged, scale, softcap, window, sinks)  # (R, Hkv, rep, Dv)
            og = og.flatten(1, 2).transpose(0, 1)  # (H, R, Dv), a view (the caller transposes it back)
            if ragged.whole:
                return og[None]
        out = q.new_zeros((n_heads, q.shape[2], self.v.shape[-1]))  # (H, T, Dv)
        if ragged is not None:
            out[:, ragged.query] = og
        for group in batch.groups:
            if group.row is not None:
                k, v = self._gather(self.k, group, "k", q.dtype), self._gather(self.v, group, "v", q.dtype)
                start, n_query, n_context = group.row
                k, v = k[:, :, :n_context], v[:, :, :n_context]  # (1, Hkv, n_context, D)
                mask = None if window is None else group.mask(window, self.block_size)[..., :n_context]
                og = backend(q[:, :, start:start + n_query], k, v, mask=mask, is_causal=mask is None, scale=scale,
                             softcap=softcap, **({} if sinks is None else {"sinks": sinks}))  # (1, H, Lq, Dv)
                out[:, start:start + n_query] = og[0]
                continue
            g, lq = group.q_index.shape
            # (H, G, Lq, D) -> (G, Hkv, rep·Lq, D): the query heads of one key/value head side by side.
            qg = q[0][:, group.q_index].view(n_kv, rep, g, lq, -1).permute(2, 0, 1, 3, 4).reshape(g, n_kv, rep * lq, -1)
            mask = group.mask(window, self.block_size, rep)  # (G, 1, rep·Lq, K)
            k, v = self._gather(self.k, group, "k", q.dtype), self._gather(self.v, group, "v", q.dtype)
            bias = None  # (k, v: (G, Hkv, K, D))
            if sinks is not None:
                k, v, mask, bias = _with_sink_key(k, v, mask, sinks, lq)
            og = backend(qg, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap)  # (G, Hkv, rep·Lq, Dv)
            og = og.view(g, n_kv, rep, lq, -1).permute(1, 2, 0, 3, 4).reshape(n_heads, g, lq, -1)  # (H, G, Lq, Dv)
            out[:, group.flat] = og.flatten(1, 2) if group.dense else og[:, group.valid]
        return out[None]

    def _gather(self, pool: Tensor, group: AttentionGroup, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """A group's blocks, ``(G, Hkv, K, D)``: one ``index_select`` along dim 0 of the pool viewed as
        ``(Hkv·blocks, block_size·D)`` (``AttentionGroup.gather_index``), into a reused buffer, read back into
        ``dtype`` (another reused buffer) when the pool holds another; the result is contiguous per row and
        key/value head."""
        heads, n, bs, d = pool.shape
        g, nb = group.tables.shape
        index = group.gather_index(heads, n)
        flat = pool.view(heads * n, bs * d)
        convert = dtype is not None and dtype != pool.dtype
        if torch.compiler.is_compiling():
            rows = flat.index_select(0, index)
            rows = rows.to(dtype) if convert else rows
        else:
            numel = index.numel() * bs * d
            rows = torch.index_select(flat, 0, index, out=self._buffer(name, numel, pool))
            rows = self._buffer(f"{name}:{dtype}", numel, pool, dtype).copy_(rows) if convert else rows
        return rows.view(g, heads, nb * bs, d)

    def _buffer(self, name: str, numel: int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``(numel / row, row)`` view of the reusable buffer ``name`` in ``dtype`` (default ``like``'s), rows of
        ``like``'s last two sizes (grown by half again when too small)."""
        buffer, dtype = self.workspace.get(name), dtype or like.dtype
        inference = torch.is_inference_mode_enabled()
        if (buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != like.device
                or buffer.is_inference() != inference):
            size = numel if buffer is None else max(numel, buffer.numel() * 3 // 2)
            buffer = self.workspace[name] = like.new_empty(size, dtype=dtype)
        return buffer[:numel].view(-1, like.shape[2] * like.shape[3])

    def _current(self) -> PagedBatch:
        if self.batch is None:
            raise ValueError("a paged cache needs its PagedBatch (cache.batch) set before a forward pass")
        return self.batch


def _with_sink_key(k: Tensor, v: Tensor, mask: Tensor, sinks: Tensor, lq: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Keys ``(G, Hkv, K, D)``, values and mask ``(G, 1, rep·Lq, K)`` of a group of ``PagedKVCache.attend`` plus a
    sink key (zero key and value, always allowed), and the additive bias ``(1, Hkv, rep·Lq, K + 1)``: 0 on the real
    keys, the query head's sink logit on the sink key (row ``r·Lq + t`` of key/value head ``h`` is query head
    ``h·rep + r``)."""
    g, n_kv, _, _ = k.shape
    rows = mask.shape[2]
    k = torch.cat([k, k.new_zeros((g, n_kv, 1, k.shape[3]))], dim=2)
    v = torch.cat([v, v.new_zeros((g, n_kv, 1, v.shape[3]))], dim=2)
    sink = sinks.to(k.dtype).view(1, n_kv, -1, 1, 1).expand(1, n_kv, rows // lq, lq, 1).reshape(1, n_kv, rows, 1)
    bias = torch.cat([sink.new_zeros((1, n_kv, rows, mask.shape[3])), sink], dim=-1)
    return k, v, torch.cat([mask, mask.new_ones((*mask.shape[:3], 1))], dim=-1), bias


class PagedLayerCache:
    """The cache of one decoder layer over a paged pool (self-attention only), as the layers expect it: a registered
    ``kv_cache`` kind built with ``(n_blocks, block_size)`` — ``"paged"``, or ``"paged_latent"`` for latent
    attention (its ``paged_cache_kind``).

    Args:
        n_blocks: blocks the pool may grow to.
        block_size: positions per block.
        kind: the registered ``kv_cache`` kind of the pool.
        dtype: the pool's float dtype (``PagedKVCache``'s), or None for the model's.
    """

    cross_attn = None

    def __init__(self, n_blocks: int, block_size: int, kind: str = "paged", dtype: torch.dtype | None = None) -> None:
        self.self_attn = get("kv_cache", kind)(n_blocks, block_size, **({} if dtype is None else {"dtype": dtype}))

    def reorder(self, index: Tensor) -> None:
        """Refused: beam search reorders contiguous caches; a paged cache shares blocks through its allocator.

        Args:
            index: the beams' new order (unused).

        Raises:
            NotImplementedError: always.

        Shapes: index ``(B,)`` long.
        """
        raise NotImplementedError("a paged cache is not reordered: requests share blocks through the allocator")
