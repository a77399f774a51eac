"""The engine's compiled step for one decoding row: what ``generate(compile=True)`` runs for one request, over the
paged cache.

A lone request decodes one token per step; eager, every one of its products is a 1-row ``F.linear`` (BLAS reads a
weight slowly for one row) and every layer costs its Python dispatch. ``SingleRowStep`` compiles the packed step of
one one-token row as ``generate(compile=True)`` compiles its batch-1 step (``models.generation.compiled``):

- every product goes through ``blocks.small_matmul.SmallRowsLinear(1)`` (one fused pass over each weight);
- the weights are graph inputs and every decoder layer of one structure is one nested compile region
  (``models.core.stack.repeated_layer_regions``): a 30-layer model compiles about as fast as a one-layer model
  (not with latent attention: its layers are inlined);
- the block counts (the row's blocks read, and the pools' blocks, which grow between steps) are dynamic
  (size-oblivious): one graph serves the whole life of the engine, whatever the row's length or the pool's size.

Only the one-token row's token, position and slot are static (one of each): a step of several rows runs the
runner's other graph (``serving.runner.DynamicStep``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor

from blocks.paged_cache import PagedBatch, PagedLayerCache
from blocks.small_matmul import SmallRowsLinear
from models.core import stack
from models.generation import compiled

#: Inductor settings of the single-row graph: no debug size asserts (a few hundred per step with weights as inputs).
OPTIONS: dict[str, Any] = {"size_asserts": False}


def one_row_mode() -> SmallRowsLinear:
    """The function mode every product of the single-row graph runs under.

    Returns:
        ``SmallRowsLinear(1)``: a 1-row ``F.linear`` as a fused reduction.
    """
    return SmallRowsLinear(1)


def single_row_logits(model: Any, ids: Tensor, positions: Tensor, caches: list[PagedLayerCache],
                      keep: Tensor) -> Tensor:
    """The logits of one one-token row over the paged cache, its products as 1-row reductions (traced by
    ``SingleRowStep``).

    Args:
        model: the ``DecoderLM``.
        ids: the row's new token.
        positions: its position.
        caches: every layer's paged cache, their ``PagedBatch`` set.
        keep: the packed index of the token (0).

    Returns:
        The row's next-token logits.

    Shapes: ids ``(1, 1)``, positions ``(1, 1)``, keep ``(1,)`` -> ``(1, V)``.
    """
    with one_row_mode():
        return model(ids, positions=positions, cache=caches, logits_to_keep=keep).logits[0]


def mark_pools(caches: list[PagedLayerCache]) -> None:
    """Mark the block dimension of every layer's pools dynamic: a pool grown between steps reuses the graph.

    Args:
        caches: every layer's paged cache.
    """
    for cache in caches:
        for pool in (cache.self_attn.k, cache.self_attn.v):
            if pool is not None:
                torch._dynamo.maybe_mark_dynamic(pool, 1)


def mark_row_blocks(batch: PagedBatch) -> None:
    """Mark how many blocks the single row reads dynamic (its ``RaggedRows`` entries, or its group's table).

    Args:
        batch: the step's packed batch of one row.
    """
    ragged = batch.ragged
    if ragged is not None:
        for tensor in (ragged.block, ragged.row, ragged.start):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(ragged.layout, 1)
    for group in batch.groups:
        torch._dynamo.maybe_mark_dynamic(group.tables, 1)


class SingleRowStep:
    """``single_row_logits`` compiled once for one runner: called as ``serving.runner.packed_logits`` on a step of
    exactly one row of one new token.

    Args:
        regions: compile each decoder layer structure once (``models.core.stack.repeated_layer_regions``); the
            runner leaves it off for latent attention, whose batch holds aliasing index tensors that a region
            cannot take.

    Raises:
        ValueError: a call with more than one token.
    """

    def __init__(self, regions: bool = True) -> None:
        self.compiled = torch.compile(compiled.own_code(single_row_logits), backend=compiled.BACKEND)
        self.regions, self.calls = regions, 0

    def __call__(self, model: Any, ids: Tensor, positions: Tensor, caches: list[PagedLayerCache],
                 keep: Tensor) -> Tensor:
        if ids.shape != (1, 1):
            raise ValueError(f"the single-row step takes one token, ids of shape (1, 1), got {tuple(ids.shape)}")
        mark_pools(caches)
        mark_row_blocks(caches[0].self_attn.batch)
        self.calls += 1
        with fx_config.patch(backed_size_oblivious=True), torch._inductor.config.patch(OPTIONS), \
                stack.repeated_layer_regions(self.regions, one_row_mode):
            return self.compiled(model, ids, positions, caches, keep)
