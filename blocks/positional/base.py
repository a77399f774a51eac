"""The interface shared by every positional encoding.

A positional encoding may act in three places, and each kind overrides the ones it uses:

- ``forward(x, positions)`` adds an encoding to the token embeddings (sinusoidal, learned);
- ``rotate(x, positions)`` rotates queries and keys inside attention (rotary);
- ``attention_bias(q_positions, k_positions)`` returns an additive attention bias (ALiBi).

Every kind is built from the model's shape, ``(d_model, n_heads, d_head, max_len, causal)``, and uses what it
needs of it (``causal`` tells a kind whether it serves a causal stack: T5's relative buckets differ).
Further constructor arguments are the kind's *options* (e.g. rotary's ``base``); a model config passes them
through ``options={"positional": {...}}``. ``positions`` are integer tensors ``(B, L)`` or ``(1, L)``.

Tables and frequencies are float32 whatever the module's dtype: ``model.to(torch.bfloat16)`` would otherwise
round the rotary frequencies and position angles (off by ~0.5 rad at position 3000). Buffers registered with
``register_fp32_buffer`` keep their float32 values through ``.to()``/``.half()``; each kind casts its result
to the input's dtype at the end.
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

    #: names of float buffers kept in float32 through dtype casts.
    _fp32_buffers: tuple[str, ...] = ()

    def register_fp32_buffer(self, name: str, tensor: Tensor) -> None:
        """A non-persistent float32 buffer that moves with the module's device but never changes dtype.

        Args:
            name: the buffer's attribute name.
            tensor: its values (stored as float32).

        Shapes: tensor: any.
        """
        self.register_buffer(name, tensor.float(), persistent=False)
        self._fp32_buffers = (*self._fp32_buffers, name)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202  (nn.Module's signature)
        kept = {name: getattr(self, name) for name in self._fp32_buffers}
        super()._apply(fn, recurse)
        for name, original in kept.items():
            moved = getattr(self, name)
            if moved.dtype != torch.float32:  # a dtype cast: keep the exact float32 values, on the new device
                self._buffers[name] = original.to(device=moved.device)
        return self

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Add positional information to the token embeddings (the base class adds nothing).

        Args:
            x: the embeddings.
            positions: each token's position.

        Returns:
            The embeddings with positions added.

        Shapes: x ``(B, L, d_model)``, positions ``(B|1, L)`` -> ``(B, L, d_model)``.
        """
        return x

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate queries or keys by their positions (the base class leaves them as they are).

        Args:
            x: queries or keys.
            positions: their positions.

        Returns:
            The rotated tensor.

        Shapes: x ``(B, H, L, D)``, positions ``(B|1, L)`` -> ``(B, H, L, D)``.
        """
        return x

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """The additive attention bias these positions give (the base class gives none).

        Args:
            q_positions: the queries' positions.
            k_positions: the keys' positions.

        Returns:
            The bias, or None.

        Shapes: q_positions ``(B, Lq)``, k_positions ``(B, Lk)`` -> ``(B, H, Lq, Lk)``.
        """
        return None

    def check_positions(self, positions: Tensor) -> None:
        """Check that no position is beyond what this encoding represents (skipped under ``torch.compile``).

        Args:
            positions: the positions about to be encoded.

        Raises:
            ValueError: a position at or past ``max_positions``, naming it.

        Shapes: positions ``(B, L)``.
        """
        if self.max_positions is None or not positions.numel() or torch.compiler.is_compiling():
            return  # (reading tensor data would break a compiled graph)
        if int(positions.max()) >= self.max_positions:
            raise ValueError(
                f"position {int(positions.max())} is out of range for {type(self).__name__} with "
                f"max_len={self.max_positions}; inputs may be at most {self.max_positions} tokens"
            )
