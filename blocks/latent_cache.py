"""The KV cache of multi-head latent attention (DeepSeek-V2 §2.1): per token, the compressed key/value latent and
the one rotary key all heads share — nothing per head.

It is a ``KVCache`` whose "keys" are the latents ``(B, 1, L, kv_lora_rank)`` and whose "values" are the rotary keys
``(B, 1, L, d_rope)``, so everything that moves, grows, reorders or buckets a ``KVCache`` (generation's cache growth,
beam search, compiled decoding's fixed-shape buffers) handles it unchanged.
"""

from __future__ import annotations

from torch import Tensor

from .kv_cache import KVCache
from .registry import register


@register("kv_cache", "latent")
class LatentKVCache(KVCache):
    """A preallocated cache of MLA latents and rotary keys (see the module docstring), written in place.

    Args:
        max_len: number of positions to preallocate.
    """

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append latents and rotary keys; return all cached so far (views).

        Args:
            k: the new positions' latents.
            v: their rotary keys.

        Returns:
            ``(latents, rotary keys)`` of every cached position.

        Shapes: k ``(B, 1, L, kv_lora_rank)``, v ``(B, 1, L, d_rope)`` -> ``(B, 1, length, ·)`` each.

        Raises:
            ValueError: more than one head (a latent cache holds one shared latent per token), or an overflow.
        """
        if k.shape[1] != 1 or v.shape[1] != 1:
            raise ValueError(
                f"a latent cache holds one latent and one rotary key per token, got {k.shape[1]} and {v.shape[1]} heads"
            )
        return super().update(k, v)

    @property
    def latent(self) -> Tensor | None:
        """The cached latents ``(B, 1, length, kv_lora_rank)`` (None before the first update)."""
        return None if self.k is None else self.k[:, :, : self.length]

    @property
    def rope_key(self) -> Tensor | None:
        """The cached rotary keys ``(B, 1, length, d_rope)`` (None before the first update)."""
        return None if self.v is None else self.v[:, :, : self.length]

    def bytes_per_token(self) -> int:
        """Bytes one cached position takes in one batch row: ``(kv_lora_rank + d_rope) · element size``.

        Returns:
            The byte count (0 before the first update).
        """
        if self.k is None:
            return 0
        return self.k.shape[-1] * self.k.element_size() + self.v.shape[-1] * self.v.element_size()
