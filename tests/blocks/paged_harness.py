"""Packed forward passes over a paged cache, step by step, for checking them against each sequence alone."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from blocks.paged_cache import BlockAllocator, PagedBatch, PagedLayerCache


def packed_steps(model: nn.Module, caches: list[PagedLayerCache], seqs: list[list[int]],
                 steps: list[list[tuple[int, int]]], block_size: int) -> tuple[Tensor, list[list[int]]]:
    """Run ``steps`` (each a list of ``(sequence index, new tokens)`` chunks packed into one forward pass) over
    blocks allocated in reverse order (non-contiguous); return every step's kept logits (each chunk's last token),
    concatenated, and each sequence's block table."""
    alloc = BlockAllocator(caches[0].self_attn.n_blocks, block_size)
    tables = [[alloc.allocate() for _ in range(-(-len(s) // block_size))][::-1] for s in seqs]
    done = [0] * len(seqs)
    kept = []
    for chunks in steps:
        rows, ids = [], []
        for i, n in chunks:
            rows.append((n, done[i] + n, tables[i]))
            ids += seqs[i][done[i] : done[i] + n]
            done[i] += n
        batch = PagedBatch(rows, block_size)
        for cache in caches:
            cache.self_attn.batch = batch
        kept.append(model(torch.tensor([ids]), positions=batch.positions[None], cache=caches,
                          logits_to_keep=batch.last).logits[0])
    return torch.cat(kept), tables
