"""The model step over a paged cache: one packed forward pass of prefill chunks and decode rows together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from blocks.paged_cache import PagedBatch, PagedLayerCache
from models.generation.steps import eval_mode


class PagedRunner:
    """Runs a ``DecoderLM`` on packed rows over its own per-layer paged pools.

    Rows are packed into one sequence ``(1, T)`` (flattened tokens, no padding in the projections and FFN);
    positions come from each row's cached length, attention gathers each row's blocks (``blocks.paged_cache``).

    Args:
        model: the ``DecoderLM``.
        n_blocks: blocks each layer's pool may grow to.
        block_size: positions per block.

    Raises:
        NotImplementedError: a positional encoding with an attention bias (ALiBi, T5's relative bias).
    """

    def __init__(self, model: Any, n_blocks: int, block_size: int) -> None:
        probe = torch.zeros(1, 1, dtype=torch.long)
        for positional in (model.positional, *model.layer_positionals.values()):
            if positional.attention_bias(probe, probe) is not None:
                raise NotImplementedError(
                    f"the paged engine does not support attention biases ({type(positional).__name__})"
                )
        self.model, self.block_size = model, block_size
        self.caches = [PagedLayerCache(n_blocks, block_size) for _ in model.layers]

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
        batch = PagedBatch(rows, self.block_size, device)
        for cache in self.caches:
            cache.self_attn.batch = batch
        with eval_mode(self.model):
            out = self.model(torch.tensor([list(ids)], device=device), positions=batch.positions[None],
                             cache=self.caches, logits_to_keep=batch.last)
        for cache in self.caches:
            cache.self_attn.batch = None
        return out.logits[0]
