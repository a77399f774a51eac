"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024, §2.1; DeepSeek-V3).

Keys and values of every head are up-projected from one low-rank latent per token, ``c = RMSNorm(x W_dkv)``
(``kv_lora_rank`` wide), and position enters through a few decoupled rotary dimensions: each query head has
``d_rope`` rotated dimensions, matched by one rotary key shared by all heads (§2.1.3). Queries may be compressed too
(``q_lora_rank``, with their own RMSNorm; DeepSeek-V2-Lite has none).

The point of MLA is its cache: per token it holds the latent and the rotary key — ``kv_lora_rank + d_rope`` numbers
per layer instead of ``2 · n_heads · d_head`` (``blocks.latent_cache``). With a cache, the up-projections are
absorbed (§2.1.2): each head's query is taken into latent space (``q_nope · W_uk``), attention runs over the cached
latents as one shared key/value head, and ``W_uv`` is applied to the result — the cached latents are never expanded
into per-head keys and values. Without a cache (training, a whole sequence), or with many new queries at once (a long
prefill; see ``absorbs``), keys and values are expanded, which costs fewer operations over many queries.

Weight names follow ``transformers``' DeepSeek checkpoints: ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .kv_cache import KVCache, StaticKVCache
from .paged_cache import PagedKVCache
from .paged_latent_cache import PagedLatentCache
from .positional.base import PositionalEncoding
from .registry import build, get, register


@register("attention", "mla")
class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (see the module docstring); self-attention only.

    Args:
        d_model: model width.
        n_heads: query heads (every head reads the same latent).
        n_kv_heads: must be None or ``n_heads`` (MLA has no key/value head groups).
        d_head: query/key width per head, ``qk_nope_head_dim + d_rope``.
        d_value: value width per head (``v_head_dim``; default ``d_head - d_rope``).
        bias: biases as DeepSeek's ``attention_bias``: on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
        dropout: dropout on the attention weights (training only).
        backend: registry name of the attention backend.
        kv_lora_rank: width of the key/value latent (at most ``d_model``).
        q_lora_rank: width of the query latent, or None for a full-rank ``q_proj``.
        d_rope: rotary dimensions per head (``qk_rope_head_dim``); the model's rotary encoding must rotate exactly
            these many.
        scale: the score scale (default ``1/sqrt(d_head)``; DeepSeek with YaRN multiplies it by ``mscale²``).
        latent_norm_eps: epsilon of the latents' RMSNorms.

    Shapes: x ``(B, L, d_model)`` -> ``(B, L, d_model)``.

    Raises:
        ValueError: a rank larger than ``d_model`` or below 1, ``d_rope`` not even or not below ``d_head``,
            ``n_kv_heads`` other than ``n_heads`` (the value named).
    """

    #: the registered ``kv_cache`` kind a decoding cache of this block must be (``models.core.stack.new_caches``).
    cache_kind = "latent"
    #: the registered ``kv_cache`` kind of its cache over a paged pool (``serving``'s engine).
    paged_cache_kind = "paged_latent"

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        d_value: int | None = None,
        bias: bool = False,
        dropout: float = 0.0,
        backend: str = "sdpa",
        kv_lora_rank: int = 512,
        q_lora_rank: int | None = None,
        d_rope: int = 64,
        scale: float | None = None,
        latent_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if d_model < 1 or n_heads < 1:
            raise ValueError(f"d_model and n_heads must be >= 1, got {d_model}, {n_heads}")
        if n_kv_heads not in (None, n_heads):
            raise ValueError(f"latent attention has no key/value head groups: n_kv_heads={n_kv_heads} must be None "
                             f"or n_heads={n_heads}")
        d_head = d_model // n_heads if d_head is None else d_head
        if isinstance(d_rope, bool) or not isinstance(d_rope, int) or d_rope < 2 or d_rope % 2 or d_rope >= d_head:
            raise ValueError(f"d_rope={d_rope!r} must be an even number >= 2 below d_head={d_head} (the rest of "
                             "each head is qk_nope_head_dim)")
        for name, rank in (("kv_lora_rank", kv_lora_rank), ("q_lora_rank", q_lora_rank)):
            if rank is None and name == "q_lora_rank":
                continue
            if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= d_model:
                raise ValueError(f"{name}={rank!r} must be an integer in [1, d_model={d_model}] (a low-rank latent)")
        d_value = d_head - d_rope if d_value is None else d_value
        if d_value < 1:
            raise ValueError(f"d_value must be >= 1, got {d_value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
            raise ValueError(f"scale must be None or a number > 0, got {scale!r}")
        self.n_heads, self.d_head, self.d_value, self.d_rope = n_heads, d_head, d_value, d_rope
        self.d_nope, self.kv_lora_rank, self.q_lora_rank = d_head - d_rope, kv_lora_rank, q_lora_rank
        self.dropout = dropout
        self.scale = 1.0 / math.sqrt(d_head) if scale is None else float(scale)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, n_heads * d_head, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=bias)
            self.q_a_layernorm = build("norm", "rmsnorm", d_model=q_lora_rank, eps=latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, n_heads * d_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_model, kv_lora_rank + d_rope, bias=bias)
        self.kv_a_layernorm = build("norm", "rmsnorm", d_model=kv_lora_rank, eps=latent_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, n_heads * (self.d_nope + d_value), bias=False)
        self.o_proj = nn.Linear(n_heads * d_value, d_model, bias=bias)
        self.set_backend(backend)

    def set_backend(self, name: str) -> None:
        """Switch the compute backend.

        Args:
            name: a registered ``attention_backend`` name.
        """
        self._backend = get("attention_backend", name)
        self.backend = name

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, d_head={self.d_head}, d_rope={self.d_rope}, d_value={self.d_value}, "
                f"kv_lora_rank={self.kv_lora_rank}, q_lora_rank={self.q_lora_rank}, backend={self.backend!r}")

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        is_causal: bool = False,
        rotary: PositionalEncoding | None = None,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` to itself; arguments as ``MultiHeadAttention.forward`` (``key_positions`` unused).

        ``cache``: a ``LatentKVCache`` (or any ``KVCache``-like cache: it is given latents as keys and rotary keys as
        values); the new tokens' latents are appended and attention runs in latent space over all of them. Or a
        ``PagedLatentCache``: ``x`` holds the packed new tokens of several sequences (``blocks.paged_latent_cache``).

        Args:
            x: the new tokens' hidden states.
            context: must be None (no cross-attention).
            mask: bool, True = may attend.
            bias: must be None.
            is_causal: bottom-right aligned causal masking.
            rotary: the rotary encoding of the ``d_rope`` dimensions.
            positions: the new tokens' positions.
            key_positions: unused (windows are not supported).
            cache: the latent cache (see above), or None.
            need_weights: also return the attention weights.

        Returns:
            ``(out, weights or None)``.

        Shapes: x ``(B, Lq, d_model)`` -> ``(B, Lq, d_model)``, weights ``(B, H, Lq, Lk)``.

        Raises:
            ValueError: cross-attention, no rotary encoding, a rotary encoding that rotates other than ``d_rope``
                dimensions, or an additive bias (none of which MLA supports).
            NotImplementedError: a per-head paged or static cache, or attention weights over a paged cache.
        """
        if context is not None:
            raise ValueError("latent attention is self-attention only (context given)")
        if rotary is None or positions is None:
            raise ValueError("latent attention needs a rotary positional encoding and the query positions")
        if getattr(rotary, "dim", self.d_rope) != self.d_rope:
            raise ValueError(f"the rotary encoding rotates {rotary.dim} dimensions, latent attention's d_rope is "
                             f"{self.d_rope} (set the positional fraction to d_rope / d_head)")
        if bias is not None:
            raise ValueError("latent attention takes no additive attention bias (ALiBi, relative); use rotary")
        paged = isinstance(cache, PagedLatentCache)
        if isinstance(cache, (PagedKVCache, StaticKVCache)) and not paged:
            raise NotImplementedError(f"latent attention cannot decode with a {type(cache).__name__} (it holds "
                                      "per-head keys); use a PagedLatentCache or a LatentKVCache")
        if paged and need_weights:
            raise NotImplementedError("a paged latent cache does not return attention weights")
        b, length, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, length, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, L, d_head)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.d_rope], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (B, 1, L, r)
        k_rope = rotary.rotate(k_rope[:, None], positions)  # (B, 1, L, d_rope): one key for every head
        q_rope = rotary.rotate(q_rope, positions)
        dropout_p = self.dropout if self.training else 0.0
        if paged:
            cache.update(latent, k_rope)
            out, weights = cache.attend(q_nope, q_rope, self._paged_rows), None
        elif cache is None:
            out, weights = self._expanded(q_nope, q_rope, latent, k_rope, mask, is_causal, dropout_p, need_weights)
        else:
            latent, k_rope = cache.update(latent, k_rope)  # (B, 1, Lk, r), (B, 1, Lk, d_rope)
            if type(self.kv_b_proj) is nn.Linear and self.absorbs(length):
                out, weights = self._absorbed(q_nope, q_rope, latent, k_rope, mask, is_causal, dropout_p,
                                              need_weights)
            else:  # many new queries (a prefill), or an adapted or quantized kv_b_proj: expand the cached latents
                out, weights = self._expanded(q_nope, q_rope, latent, k_rope, mask, is_causal, dropout_p,
                                              need_weights)
        out = out.transpose(1, 2).reshape(b, length, self.n_heads * self.d_value)  # (B, L, H*Dv)
        return self.o_proj(out), weights

    def absorbs(self, n_queries: int) -> bool:
        """Whether attending from ``n_queries`` new queries to cached latents absorbs the up-projections.

        Per head, query and key, absorbed scores cost ``2·r + d_rope`` multiply-adds (``r = kv_lora_rank``) against
        ``d_head + d_value`` expanded; expanding costs ``r · (d_nope + d_value)`` per head and key once. So absorb
        while ``n_queries · (2r − d_nope − d_value) < r · (d_nope + d_value)``: decoding steps (a few queries) absorb,
        a long prefill expands (DeepSeek-V2-Lite's shapes: up to 170 queries).

        Args:
            n_queries: new queries per row.

        Returns:
            True to absorb, False to expand.
        """
        r, spent = self.kv_lora_rank, self.d_nope + self.d_value
        return n_queries * (2 * r - spent) < r * spent

    def _paged_rows(self, q_nope: Tensor, q_rope: Tensor, keys: Tensor, mask: Tensor) -> Tensor:
        """One group of a paged batch (``PagedLatentCache.attend``): keys ``(G, 1, K, r + d_rope)`` are the cached
        ``[latent, rotary key]`` rows; absorbed or expanded as ``forward`` chooses for a contiguous cache."""
        latent, k_rope = keys.split([self.kv_lora_rank, self.d_rope], dim=-1)
        if type(self.kv_b_proj) is nn.Linear and self.absorbs(q_nope.shape[2]):
            return self._absorbed(q_nope, q_rope, latent, k_rope, mask, False, 0.0, False, key=keys)[0]
        return self._expanded(q_nope, q_rope, latent, k_rope, mask, False, 0.0, False)[0]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float,
                need_weights: bool) -> tuple[Tensor, Tensor | None]:
        if need_weights:
            return get("attention_backend", "math")(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                                    scale=self.scale, return_weights=True)
        return self._backend(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=self.scale), None

    def _expanded(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, mask: Tensor | None,
                  is_causal: bool, dropout_p: float, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Per-head keys and values from the latents (``kv_b_proj``), then ordinary attention."""
        b, _, lk, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(b, lk, self.n_heads, self.d_nope + self.d_value).transpose(1, 2)
        k_nope, v = kv.split([self.d_nope, self.d_value], dim=-1)  # (B, H, Lk, d_nope), (B, H, Lk, Dv)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)  # (B, H, Lk, d_head)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return self._attend(q, k, v, mask, is_causal, dropout_p, need_weights)

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, mask: Tensor | None,
                  is_causal: bool, dropout_p: float, need_weights: bool, key: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
        """§2.1.2: ``q_nope · k_nope = (q_nope W_uk) · c`` and ``p · v = (p · c) W_uv``: attention over the latents
        as one key/value head of width ``kv_lora_rank (+ d_rope for the keys)``."""
        b, h, lq, _ = q_nope.shape
        weight = self.kv_b_proj.weight.view(h, self.d_nope + self.d_value, self.kv_lora_rank)
        w_uk, w_uv = weight.split([self.d_nope, self.d_value], dim=1)  # (H, d_nope, r), (H, Dv, r)
        q = torch.cat([torch.einsum("bhld,hdr->bhlr", q_nope, w_uk), q_rope], dim=-1)  # (B, H, Lq, r + d_rope)
        k = torch.cat([latent, k_rope], dim=-1) if key is None else key  # (B, 1, Lk, r + d_rope)
        if lq == 1 and (mask is None or (mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1)):
            # One query per head (a decoding step): the heads are the queries of one shared head, so the cached
            # latents are read once, not once per head; one query sees every key, so nothing causal to mask.
            out, weights = self._attend(q.transpose(1, 2), k, latent, mask, False, dropout_p, need_weights)
            out = out.transpose(1, 2)  # (B, H, 1, r)
            weights = None if weights is None else weights.transpose(1, 2)
        else:
            out, weights = self._attend(q, k, latent, mask, is_causal, dropout_p, need_weights)  # (B, H, Lq, r)
        return torch.einsum("bhlr,hvr->bhlv", out, w_uv), weights
