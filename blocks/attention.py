"""Multi-head attention (paper §3.2.2) with grouped key/value heads (GQA, MQA), self or cross."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .backends.common import check_softcap
from .kv_cache import KVCache, StaticKVCache
from .paged_cache import PagedKVCache
from .positional.base import PositionalEncoding
from .quantized.joint import joint_linear
from .registry import build, get, register


@register("attention", "mha")
class MultiHeadAttention(nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O`` with ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``.

    ``n_kv_heads < n_heads`` shares each key/value head among ``n_heads // n_kv_heads`` query heads
    (GQA; ``n_kv_heads=1`` is MQA). The compute backend is a registered ``attention_backend`` chosen
    per module and switchable at runtime with ``set_backend``.

    Args:
        d_model: width of the queries' input (and of the output).
        n_heads: query heads.
        n_kv_heads: key/value heads (default ``n_heads``); must divide ``n_heads``.
        d_head: query/key width per head (default ``d_model // n_heads``).
        d_value: value width per head (default ``d_head``; Table 3 row B varies d_k alone).
        bias: whether the projections have biases.
        dropout: dropout on the attention weights (training only).
        backend: registry name of the attention backend.
        d_context: width of the key/value input for cross-attention (default ``d_model``).

    Options (``options={"attention": {...}}`` in a model config, per layer through ``layer_options``):
        qkv_bias: biases on q/k/v but not on the output projection (Qwen2), overriding ``bias`` for q/k/v.
        scale: the score scale (default ``1/sqrt(d_head)``; T5 uses 1, Gemma 2 ``query_pre_attn_scalar^-1/2``).
        softcap: attention-logit soft-capping ``softcap · tanh(score / softcap)`` (Gemma 2).
        qk_norm: a registered norm applied to each head of q and k before rotary (Qwen3, OLMo 2), with
            ``qk_norm_eps``; parameters ``q_norm``/``k_norm`` of width ``d_head``.
        qk_norm_scope: ``"head"`` (default: each head normalised alone) or ``"projection"``: the norms span the whole
            q and k projections (``n_heads · d_head`` and ``n_kv_heads · d_head`` wide; OLMoE, OLMo 2).
        window: sliding-window attention: a query attends only to keys less than ``window`` positions away
            (Mistral, Gemma 2's local layers, ModernBERT's local layers); positions count real tokens.
        sinks: attention sinks (gpt-oss): a learned logit per query head, parameter ``sinks`` ``(n_heads,)``, that
            joins every softmax denominator as a key with no value, so a head may attend to (almost) nothing.

    Raises:
        ValueError: naming the bad value: heads that do not divide, widths below 1, a dropout outside [0, 1), a
            scale, window or ``qk_norm_scope`` out of range.

    Shapes: x ``(B, Lq, d_model)``, context ``(B, Lk, d_context)`` -> ``(B, Lq, d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        d_value: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        backend: str = "sdpa",
        d_context: int | None = None,
        qkv_bias: bool | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        window: int | None = None,
        sinks: bool = False,
        qk_norm_scope: str = "head",
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model < 1 or n_heads < 1 or n_kv_heads < 1:
            raise ValueError(
                f"d_model, n_heads and n_kv_heads must be >= 1, got {d_model}, {n_heads}, {n_kv_heads}"
            )
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be divisible by n_kv_heads={n_kv_heads}")
        if d_head is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by n_heads={n_heads}; give d_head explicitly"
                )
            d_head = d_model // n_heads
        d_value = d_head if d_value is None else d_value
        if d_head < 1 or d_value < 1:
            raise ValueError(f"d_head and d_value must be >= 1, got {d_head}, {d_value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
            raise ValueError(f"scale must be None or a number > 0, got {scale!r}")
        check_softcap(softcap)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or a positive integer, got {window!r}")
        if isinstance(qk_norm_eps, bool) or not isinstance(qk_norm_eps, (int, float)) or not 0 < qk_norm_eps < math.inf:
            raise ValueError(f"qk_norm_eps must be a finite number > 0, got {qk_norm_eps!r}")
        if qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"qk_norm_scope must be 'head' or 'projection', got {qk_norm_scope!r}")
        d_context = d_model if d_context is None else d_context
        self.n_heads, self.n_kv_heads, self.d_head, self.d_value = n_heads, n_kv_heads, d_head, d_value
        self.dropout = dropout
        self.scale, self.softcap, self.window = scale, softcap, window
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(d_model, n_heads * d_head, bias=qkv_bias)
        self.k_proj = nn.Linear(d_context, n_kv_heads * d_head, bias=qkv_bias)
        self.v_proj = nn.Linear(d_context, n_kv_heads * d_value, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * d_value, d_model, bias=bias)
        self.q_norm = self.k_norm = None
        self.qk_norm_scope = qk_norm_scope
        if qk_norm is not None:
            whole = qk_norm_scope == "projection"
            self.q_norm = build("norm", qk_norm, d_model=d_head * (n_heads if whole else 1), eps=qk_norm_eps)
            self.k_norm = build("norm", qk_norm, d_model=d_head * (n_kv_heads if whole else 1), eps=qk_norm_eps)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.set_backend(backend)

    def set_backend(self, name: str) -> None:
        """Switch the compute backend.

        Args:
            name: a registered ``attention_backend`` name (``math``, ``sdpa``, ``flex``, ``chunked``).
        """
        self._backend = get("attention_backend", name)
        self.backend = name

    def extra_repr(self) -> str:
        extra = "".join(
            f", {name}={getattr(self, name)}" for name in ("scale", "softcap", "window")
            if getattr(self, name) is not None
        )
        return (
            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, d_head={self.d_head}, "
            f"backend={self.backend!r}{extra}"
        )

    def _project(self, x: Tensor, projections: tuple[nn.Linear, ...]) -> tuple[Tensor, ...]:
        """Apply several projections of the same input, as one matmul on their concatenated weights in training.

        One large matmul runs faster than three small ones over many tokens (better blocking, one backward
        kernel instead of three); the parameters stay separate (``q_proj``, ``k_proj``, ``v_proj``) so
        checkpoints keep common names. Without autograd (inference, decoding one token at a time) the
        projections run one by one: concatenating the weights would read and write them all once more per
        call, which costs more than it saves when the work is bound by reading weights. Projections that are
        not plain ``nn.Linear`` modules, or that carry hooks, are called one by one — except GGUF-block layers
        (``blocks.quantized.joint_linear``), which one kernel call multiplies together.
        """
        joint = joint_linear(x, projections)
        if joint is not None:
            return joint
        if (
            not torch.is_grad_enabled()
            or not all(_plain_linear(proj) for proj in projections)
            or len({proj.bias is None for proj in projections}) > 1
        ):
            return tuple(proj(x) for proj in projections)
        weight = torch.cat([proj.weight for proj in projections])
        bias = None if projections[0].bias is None else torch.cat([proj.bias for proj in projections])
        sizes = [proj.out_features for proj in projections]
        return F.linear(x, weight, bias).split(sizes, dim=-1)

    def _normed(self, norm: nn.Module | None, x: Tensor, n_heads: int) -> Tensor:
        """Split a q or k projection into heads with its norm (before the rotation): per head (Qwen3) or over the
        whole projection (OLMoE)."""
        if norm is not None and self.qk_norm_scope == "projection":
            x = norm(x)
        x = self._split(x, n_heads)
        return norm(x) if norm is not None and self.qk_norm_scope == "head" else x

    def _split(self, x: Tensor, n_heads: int) -> Tensor:
        b, length, width = x.shape
        return x.view(b, length, n_heads, width // n_heads).transpose(1, 2)  # (B, H, L, D); B or L may be 0

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
        cache: KVCache | StaticKVCache | PagedKVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` to itself (``context=None``) or to ``context``.

        Args:
            x: queries' input ``(B, Lq, d_model)``.
            context: keys'/values' input for cross-attention ``(B, Lk, d_context)``; may be None
                when a filled ``StaticKVCache`` is given.
            mask: bool, True = may attend, broadcastable to ``(B, H, Lq, Lk)``.
            bias: additive attention bias broadcastable to ``(B, H, Lq, Lk)``.
            is_causal: bottom-right aligned causal masking (in the backend).
            rotary: a positional encoding whose ``rotate`` is applied to q and k (self-attention).
            positions: ``(B, Lq)`` positions of the queries (and of the new keys), for ``rotary`` and ``window``.
            key_positions: ``(B, Lk)`` positions of all keys, cached ones included (default ``positions``), for
                ``window``.
            cache: ``KVCache`` (self-attention: new keys appended), ``StaticKVCache`` (cross-attention:
                keys/values computed once) or ``PagedKVCache`` (packed rows ``(1, T)`` over a paged pool).
            need_weights: also return the attention weights, computed by the ``math`` backend.

        Returns:
            ``(out, weights)``: out ``(B, Lq, d_model)``; weights ``(B, H, Lq, Lk)`` or None.

        Raises:
            ValueError: rotary attention without ``positions``.
            NotImplementedError: a paged cache with an attention bias or ``need_weights``.

        Shapes: x ``(B, Lq, d_model)``, context ``(B, Lk, d_context)`` -> ``(B, Lq, d_model)``.
        """
        if isinstance(cache, StaticKVCache) and cache.filled:
            q = self._normed(self.q_norm, self.q_proj(x), self.n_heads)  # (B, H, Lq, Dk)
            k, v = cache.k, cache.v
        else:
            if context is None:  # self-attention: one fused matmul for q, k and v
                q, k, v = self._project(x, (self.q_proj, self.k_proj, self.v_proj))
            else:
                q = self.q_proj(x)
                k, v = self._project(context, (self.k_proj, self.v_proj))
            q = self._normed(self.q_norm, q, self.n_heads)  # (B, H, Lq, Dk)
            k = self._normed(self.k_norm, k, self.n_kv_heads)  # (B, Hkv, Lk, Dk)
            v = self._split(v, self.n_kv_heads)  # (B, Hkv, Lk, Dv)
            if rotary is not None and context is None:
                if positions is None:
                    raise ValueError("rotary attention needs the query positions")
                k = rotary.rotate(k, positions)
            if isinstance(cache, StaticKVCache):
                k, v = cache.set(k, v)
            elif cache is not None:
                k, v = cache.update(k, v)
        if rotary is not None and context is None:
            q = rotary.rotate(q, positions)
        if isinstance(cache, PagedKVCache):  # packed rows: the cache gathers each row's keys (blocks/paged_cache.py)
            if bias is not None or need_weights:
                raise NotImplementedError("a paged cache supports neither attention biases (ALiBi) nor need_weights")
            out = cache.attend(q, self._backend, scale=self.scale, softcap=self.softcap, window=self.window,
                               sinks=self.sinks)
            return self.o_proj(out.transpose(1, 2).flatten(2)), None  # (1, T, H*Dv)
        if self.window is not None:
            mask = self._window_mask(mask, positions, key_positions)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            out, weights = get("attention_backend", "math")(
                q, k, v, mask=mask, bias=bias, is_causal=is_causal, dropout_p=dropout_p, scale=self.scale,
                softcap=self.softcap, sinks=self.sinks, return_weights=True,
            )
        else:
            out = self._backend(
                q, k, v, mask=mask, bias=bias, is_causal=is_causal, dropout_p=dropout_p, scale=self.scale,
                softcap=self.softcap, **({} if self.sinks is None else {"sinks": self.sinks}),
            )
        b, _, lq, _ = out.shape
        out = out.transpose(1, 2).reshape(b, lq, self.n_heads * self.d_value)  # (B, Lq, H*Dv)
        return self.o_proj(out), weights


    def _window_mask(self, mask: Tensor | None, positions: Tensor | None, key_positions: Tensor | None) -> Tensor:
        """``mask`` restricted to keys less than ``window`` positions from each query."""
        if positions is None:
            raise ValueError("sliding-window attention needs the query positions")
        key_positions = positions if key_positions is None else key_positions
        distance = positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, Lq, Lk)
        near = distance.abs() < self.window
        return near if mask is None else mask & near


def _plain_linear(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )
