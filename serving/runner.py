"""The model step over a paged cache: one packed forward pass of prefill chunks and decode rows together.

With ``compile=True`` the steps whose rows all decode one token run a compiled graph instead (as
``generate(compile=True)`` does for one request): the rows are padded to a bucket of rows (powers of two from
``MIN_ROWS``) and each row's block table to a bucket of blocks (powers of two from ``MIN_BLOCKS``), so shapes are
static and one graph serves every step of a bucket whatever the positions and blocks. Padding rows write to and read
a scratch block past the allocator's ids; the pools are allocated whole. Steps holding a prefill chunk stay eager.

With ``compile="attention"`` (and in the eager steps of ``compile=True``) only the attention of each group of
one-token rows is compiled (``blocks.paged_cache.fused_group_attention``, ``FusedAttention``): one graph whose
row and block counts are dynamic, so every step, a prefill chunk's included, reads each row's keys and values once
in place instead of gathering copies of them for the backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor

from blocks import get
from blocks.paged_cache import PagedBatch, PagedKVCache, PagedLayerCache, fused_group_attention
from models.generation import compiled
from models.generation.steps import eval_mode

#: The values of ``compile`` (``PagedRunner``, ``serving.Engine``).
COMPILE_MODES = (False, True, "attention")
#: The smallest buckets of the compiled decode step: rows per step and blocks per row.
MIN_ROWS, MIN_BLOCKS = 8, 4


def check_compile(compile: Any) -> None:  # noqa: A002
    """Raise ``ValueError`` unless ``compile`` is one of ``COMPILE_MODES``."""
    if not (isinstance(compile, bool) or compile == "attention"):
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")


def bucket(n: int, smallest: int) -> int:
    """The smallest power-of-two multiple of ``smallest`` holding ``n``."""
    size = smallest
    while size < n:
        size *= 2
    return size


def packed_logits(model: Any, ids: Tensor, positions: Tensor, caches: list[PagedLayerCache], keep: Tensor) -> Tensor:
    """One packed forward pass: the logits at ``keep``, ``(len(keep), V)`` (the function the compiled step wraps)."""
    return model(ids, positions=positions, cache=caches, logits_to_keep=keep).logits[0]


def paged_kind(layer: Any) -> str:
    """The registered ``kv_cache`` kind of a decoder layer's paged cache: its attention's ``paged_cache_kind``
    (``"paged_latent"`` for latent attention), ``"paged"`` by default."""
    return getattr(layer.self_attn, "paged_cache_kind", "paged")


def block_nbytes(model: Any, block_size: int) -> int:
    """Bytes one paged block of ``block_size`` positions takes over every layer of ``model``, in its dtype."""
    element = next(model.parameters()).element_size()
    return block_size * element * sum(get("kv_cache", paged_kind(layer)).numbers_per_position(layer.self_attn)
                                      for layer in model.layers)


class BucketedStep:
    """``packed_logits`` compiled once per shape bucket, each under a code object of its own: dynamo keeps its graphs
    per code object and stops compiling one after ``recompile_limit`` (8) shapes, which a workload's buckets of rows
    × blocks exceed. Called as ``packed_logits``."""

    def __init__(self) -> None:
        self.compiled: dict[tuple[int, ...], Callable[..., Tensor]] = {}

    def __call__(self, model: Any, ids: Tensor, positions: Tensor, caches: list[PagedLayerCache],
                 keep: Tensor) -> Tensor:
        key = (ids.shape[1], caches[0].self_attn.batch.groups[0].tables.shape[1])
        if key not in self.compiled:
            self.compiled[key] = torch.compile(compiled.own_code(packed_logits), dynamic=False,
                                               backend=compiled.BACKEND)
        return self.compiled[key](model, ids, positions, caches, keep)


class FusedAttention:
    """``fused_group_attention`` compiled for one runner, under a code object of its own (the graphs of one model's
    shapes are not offered to another's), with the row and block counts of its inputs marked dynamic: one graph
    serves every group, of one row or one block included. Called as ``fused_group_attention``."""

    def __init__(self) -> None:
        self.compiled = torch.compile(compiled.own_code(fused_group_attention), backend=compiled.BACKEND)

    def __call__(self, k_pool: Tensor, v_pool: Tensor, q: Tensor, index: Tensor, mask: Tensor,
                 *args: Any) -> Tensor:
        for tensor, dims in ((k_pool, (1,)), (v_pool, (1,)), (q, (0,)), (index, (0, 2)), (mask, (0, 3))):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        # Size-oblivious: a count of 1 is not specialised (no second graph for a group of one row or one block).
        with fx_config.patch(backed_size_oblivious=True):
            return self.compiled(k_pool, v_pool, q, index, mask, *args)


class PagedRunner:
    """Runs a ``DecoderLM`` on packed rows over its own per-layer paged pools.

    Rows are packed into one sequence ``(1, T)`` (flattened tokens, no padding in the projections and FFN);
    positions come from each row's cached length, attention gathers each row's blocks (``blocks.paged_cache``).

    Args:
        model: the ``DecoderLM``.
        n_blocks: blocks each layer's pool may grow to.
        block_size: positions per block.
        compile: ``True``: run decode-only steps through a compiled graph per (rows, blocks) bucket, and the
            attention of one-token rows in the other steps through ``FusedAttention``; ``"attention"``: only the
            latter (every step stays eager around one compiled attention graph); ``False``: nothing compiled.

    Raises:
        NotImplementedError: a positional encoding with an attention bias (ALiBi, T5's relative bias).
    """

    def __init__(self, model: Any, n_blocks: int, block_size: int, compile: bool | str = False) -> None:  # noqa: A002
        check_compile(compile)
        probe = torch.zeros(1, 1, dtype=torch.long)
        for positional in (model.positional, *model.layer_positionals.values()):
            if positional.attention_bias(probe, probe) is not None:
                raise NotImplementedError(
                    f"the paged engine does not support attention biases ({type(positional).__name__})"
                )
        self.model, self.block_size, self.n_blocks = model, block_size, n_blocks
        self.step = None
        if compile is not True:
            self.caches = [PagedLayerCache(n_blocks, block_size, paged_kind(layer)) for layer in model.layers]
            self._share_workspace()
            if compile == "attention":
                self._fuse_attention()
            return
        # Whole pools with one scratch block (id n_blocks) for padding rows: no growth inside a graph.
        self.caches = [PagedLayerCache(n_blocks + 1, block_size, paged_kind(layer)) for layer in model.layers]
        for layer, cache in zip(model.layers, self.caches, strict=True):
            cache.self_attn.reserve(layer.self_attn, model.embed_tokens.weight)
        self._share_workspace()
        self._fuse_attention()
        self.step = BucketedStep()

    def _fuse_attention(self) -> None:
        attention = FusedAttention()
        for cache in self.caches:
            if isinstance(cache.self_attn, PagedKVCache):  # latent caches attend their own way
                cache.self_attn.fused_attention = attention

    def _share_workspace(self) -> None:
        workspace: dict[str, Tensor] = {}  # each layer's gathers are consumed before the next layer's
        for cache in self.caches:
            cache.self_attn.workspace = workspace

    @torch.inference_mode()
    def scrub(self, blocks: Sequence[int]) -> None:
        """Zero ``blocks`` in every layer's pools (what a failed request wrote must not be read again: a masked
        slot of a reused block still enters the attention products)."""
        index = torch.as_tensor(list(blocks), dtype=torch.long)
        for cache in self.caches:
            cache.self_attn.scrub(index)

    @property
    def nbytes(self) -> int:
        """Bytes the key/value pools hold now."""
        return sum(cache.self_attn.nbytes for cache in self.caches)

    def block_nbytes(self) -> int:
        """Bytes one block takes over all layers (0 before the first step)."""
        return sum(cache.self_attn.block_nbytes() for cache in self.caches)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], rows: Sequence[tuple[int, int, Sequence[int]]]) -> Tensor:
        """Logits at the last new token of each row.

        Args:
            ids: the new tokens of every row, concatenated.
            rows: per row ``(n_new, n_cached_after, block_table)`` (see ``PagedBatch``).

        Returns:
            ``(n_rows, vocab_size)`` float logits.
        """
        device = self.model.embed_tokens.weight.device
        step, n_rows, ids = packed_logits, len(rows), list(ids)
        if self.step is not None and all(n_query == 1 for n_query, _, _ in rows):
            pad_rows = bucket(n_rows, MIN_ROWS)
            blocks = max(-(-n_context // self.block_size) for _, n_context, _ in rows)
            batch = PagedBatch(rows, self.block_size, device, pad_rows=pad_rows, pad_blocks=bucket(blocks, MIN_BLOCKS),
                               scratch=self.n_blocks, capacity=self.n_blocks + 1)
            step, ids = self.step, ids + [0] * (pad_rows - n_rows)
        else:
            batch = PagedBatch(rows, self.block_size, device, capacity=None if self.step is None else self.n_blocks + 1)
        for cache in self.caches:
            cache.self_attn.batch = batch
        # eval_mode sets and restores every submodule's flag (a tenth of a small step): only when one is training.
        training = any(m.training for m in self.model.modules())
        with eval_mode(self.model) if training else contextlib.nullcontext():
            logits = step(self.model, torch.tensor([ids], device=device), batch.positions[None], self.caches,
                          batch.last)
        for cache in self.caches:
            cache.self_attn.batch = None
        return logits[:n_rows]
