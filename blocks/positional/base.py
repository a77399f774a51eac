"""The interface shared by every positional encoding.

A positional encoding may act in three places, and each kind overrides the ones it uses:

- ``forward(x, positions)`` adds an encoding to the token embeddings (sinusoidal, learned);
- ``rotate(x, positions)`` rotates queries and keys inside attention (rotary);
- ``attention_bias(q_positions, k_positions)`` returns an additive attention bias (ALiBi).

Every kind is built from the model's shape, ``(d_model, n_heads, d_head, max_len)``, and uses what it
needs of it. ``positions`` are integer tensors ``(B, L)`` or ``(1, L)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PositionalEncoding(nn.Module):
    """Base class: the identity in all three places."""

    #: True if ``rotate`` is not the identity (attention modules then call it on q and k).
    rotates: bool = False
    #: Largest position + 1 the encoding can represent, or None if it extends on demand.
    max_positions: int | None = None

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Return the embeddings ``x`` ``(B, L, d_model)`` with positional information added."""
        return x

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate queries or keys ``(B, H, L, D)`` by their positions ``(B, L)``."""
        return x

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Additive bias ``(B, H, Lq, Lk)`` from positions ``(B, Lq)`` and ``(B, Lk)``, or None."""
        return None

    def check_positions(self, positions: Tensor) -> None:
        """Raise ``ValueError`` if a position is beyond what this encoding represents."""
        if self.max_positions is None or not positions.numel() or torch.compiler.is_compiling():
            return  # (reading tensor data would break a compiled graph)
        if int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is out of range for {type(self).__name__} with "
                f"max_len={self.max_positions}; inputs may be at most {self.max_positions} tokens"
            )
