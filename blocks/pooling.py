"""Pooling: one vector per sequence from its hidden states, as sentence-transformers' ``Pooling`` computes it.

Used by the sequence-classification and embedding heads (``blocks.heads``) and by ``models.tasks`` for packed rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: the poolings ``pool`` computes (sentence-transformers' ``pooling_mode_*`` names, ``mean_sqrt_len`` its
#: ``mean_sqrt_len_tokens``).
POOLINGS = ("cls", "mean", "max", "last", "mean_sqrt_len")


def pool(x: Tensor, mask: Tensor | None, pooling: str) -> Tensor:
    """One vector per sequence from hidden states, as sentence-transformers' ``Pooling`` computes it.

    ``cls``: the first real token; ``last``: the rightmost real token (left or right padding); ``mean`` / ``max`` /
    ``mean_sqrt_len``: over the real tokens (the sum divided by the square root of their count for the last).

    Args:
        x: the hidden states.
        mask: True where a token is real (padding is left out of every pooling), or None when every token is.
        pooling: one of ``POOLINGS``.

    Returns:
        One vector per sequence (a row without real tokens pools to zeros with ``mean``).

    Shapes: ``x (B, L, D)``, ``mask (B, L)`` bool (True = real token) or None -> ``(B, D)``.

    Raises:
        ValueError: an unknown pooling.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {list(POOLINGS)}")
    if pooling == "cls":
        if mask is None:
            return x[:, 0]
        first = mask.int().argmax(-1)  # the first real token  # (B,)
        return x[torch.arange(x.shape[0], device=x.device), first]
    if pooling == "last":
        if mask is None:
            return x[:, -1]
        index = torch.arange(x.shape[1], device=x.device)
        last = (index * mask.long()).argmax(-1)  # the rightmost real token  # (B,)
        return x[torch.arange(x.shape[0], device=x.device), last]
    if pooling == "max":
        if mask is None:
            return x.max(dim=1).values
        return x.masked_fill(~mask[..., None], torch.finfo(x.dtype).min).max(dim=1).values
    weights = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
    total = (x * weights[..., None]).sum(dim=1)  # (B, D)
    count = weights.sum(dim=1, keepdim=True).clamp(min=1e-9)  # (B, 1)
    return total / (count if pooling == "mean" else count.sqrt())
