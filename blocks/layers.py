"""Encoder, decoder and parallel-residual layers, composed from injected blocks (paper §3.1, Figure 1).

A layer is built from the modules passed in; the builder functions ``encoder_layer``, ``decoder_layer`` and
``parallel_layer`` (registered under kind ``layer``) look the blocks up by registry name and pass each block
its options (``options={"attention": {...}, "ffn": {...}, "norm": {...}, "sublayer": {...}}``).

Each sublayer reads the same way: ``h = sublayer.normalize(x)``, ``h = attention(h)``, ``x = sublayer.residual(x, h)``
(see ``blocks.sublayer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from .kv_cache import LayerCache
from .positional.base import PositionalEncoding
from .registry import build, register

#: The block options a layer builder passes on, by the kind of block they configure.
LAYER_OPTION_KINDS = ("attention", "ffn", "norm", "sublayer")

#: Keys of each block that the layer builder sets itself (an option may not override them).
SUPPLIED: dict[str, tuple[str, ...]] = {
    "attention": ("d_model", "n_heads", "n_kv_heads", "d_head", "d_value", "dropout", "backend", "d_context"),
    "ffn": ("d_model", "d_ff"),
    "norm": ("d_model", "eps"),
    "sublayer": ("norm", "dropout"),
    "head": ("d_model", "vocab_size", "make_norm", "bias", "dropout"),  # blocks.heads.HEAD_SUPPLIED
}


class EncoderLayer(nn.Module):
    """Self-attention then a feed-forward network, each wrapped in a residual sublayer connection.

    Args:
        self_attn: the self-attention block (e.g. ``MultiHeadAttention``).
        ffn: the feed-forward block.
        self_attn_sublayer: the residual connection (and norm) around the attention.
        ffn_sublayer: the residual connection (and norm) around the feed-forward block.

    Shapes: ``(B, L, d_model)`` -> ``(B, L, d_model)``.
    """

    def __init__(
        self, self_attn: nn.Module, ffn: nn.Module, self_attn_sublayer: nn.Module, ffn_sublayer: nn.Module
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.self_attn_sublayer = self_attn_sublayer
        self.ffn = ffn
        self.ffn_sublayer = ffn_sublayer

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        is_causal: bool = False,
        rotary: PositionalEncoding | None = None,
        positions: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Run the layer.

        Args:
            x: the hidden states.
            mask: bool attention mask, True = may attend.
            bias: additive attention bias (ALiBi, relative positions).
            is_causal: attend causally (bottom-right aligned).
            rotary: the rotary encoding to apply to queries and keys, if any.
            positions: each token's position, for ``rotary``.
            need_weights: also return the attention weights (computed by the ``math`` backend).

        Returns:
            ``(x, self-attention weights or None)``.

        Shapes: x ``(B, L, d_model)``, mask broadcastable to ``(B, H, L, L)``, positions ``(B, L)`` ->
        ``(B, L, d_model)``, weights ``(B, H, L, L)``.
        """
        h = self.self_attn_sublayer.normalize(x)
        h, weights = self.self_attn(
            h, mask=mask, bias=bias, is_causal=is_causal, rotary=rotary, positions=positions, need_weights=need_weights
        )
        x = self.self_attn_sublayer.residual(x, h)
        h = self.ffn(self.ffn_sublayer.normalize(x))
        x = self.ffn_sublayer.residual(x, h)
        return x, weights


class DecoderLayer(nn.Module):
    """Masked self-attention, optional cross-attention over the encoder memory, then a feed-forward
    network, each in a residual sublayer connection (§3.1). Without ``cross_attn`` it is a GPT block.

    Args:
        self_attn: the self-attention block.
        ffn: the feed-forward block.
        self_attn_sublayer: the residual connection (and norm) around the self-attention.
        ffn_sublayer: the residual connection (and norm) around the feed-forward block.
        cross_attn: the cross-attention block over the encoder memory, or None (decoder-only).
        cross_attn_sublayer: its residual connection; given exactly when ``cross_attn`` is.

    Raises:
        ValueError: ``cross_attn`` without ``cross_attn_sublayer`` or the other way round.

    Shapes: x ``(B, L, d_model)``, memory ``(B, S, d_model)`` -> ``(B, L, d_model)``.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        ffn: nn.Module,
        self_attn_sublayer: nn.Module,
        ffn_sublayer: nn.Module,
        cross_attn: nn.Module | None = None,
        cross_attn_sublayer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if (cross_attn is None) != (cross_attn_sublayer is None):
            raise ValueError("cross_attn and cross_attn_sublayer must be given together")
        self.self_attn = self_attn
        self.self_attn_sublayer = self_attn_sublayer
        self.cross_attn = cross_attn
        self.cross_attn_sublayer = cross_attn_sublayer
        self.ffn = ffn
        self.ffn_sublayer = ffn_sublayer

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        bias: Tensor | None = None,
        rotary: PositionalEncoding | None = None,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
        cache: LayerCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Causal self-attention (``mask`` is combined with the bottom-right causal mask), then cross-attention and
        the feed-forward block.

        Args:
            x: the hidden states of the new tokens.
            memory: the encoder's output (with cross-attention).
            mask: bool self-attention mask, True = may attend.
            memory_mask: bool cross-attention mask over ``memory``.
            bias: additive self-attention bias.
            rotary: the rotary encoding to apply to queries and keys, if any.
            positions: the new tokens' positions.
            key_positions: the positions of every key, cached ones included (for sliding windows).
            cache: this layer's KV caches (self- and cross-attention), updated in place.
            need_weights: also return the attention weights.

        Returns:
            ``(x, self-attention weights, cross-attention weights)`` (weights None unless asked).

        Shapes: x ``(B, L, d_model)``, memory ``(B, S, d_model)``, positions ``(B, L)``, key_positions
        ``(B, Lk)`` -> ``(B, L, d_model)``.
        """
        h = self.self_attn_sublayer.normalize(x)
        h, self_weights = self.self_attn(
            h, mask=mask, bias=bias, is_causal=True, rotary=rotary, positions=positions, key_positions=key_positions,
            cache=None if cache is None else cache.self_attn, need_weights=need_weights,
        )
        x = self.self_attn_sublayer.residual(x, h)
        cross_weights = None
        if self.cross_attn is not None:
            h = self.cross_attn_sublayer.normalize(x)
            h, cross_weights = self.cross_attn(
                h, memory, mask=memory_mask, cache=None if cache is None else cache.cross_attn,
                need_weights=need_weights,
            )
            x = self.cross_attn_sublayer.residual(x, h)
        h = self.ffn(self.ffn_sublayer.normalize(x))
        x = self.ffn_sublayer.residual(x, h)
        return x, self_weights, cross_weights


class ParallelDecoderLayer(DecoderLayer):
    """Attention and feed-forward network side by side on the same input, one residual sum (GPT-J, GPT-NeoX,
    PaLM): ``x + Attention(Norm1(x)) + FFN(Norm2(x))``. Needs pre-norm sublayers (their ``normalize`` gives each
    branch its input, their ``residual`` adds its output). No cross-attention.

    Shapes: ``(B, L, d_model)`` -> ``(B, L, d_model)``.
    """

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        bias: Tensor | None = None,
        rotary: PositionalEncoding | None = None,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
        cache: LayerCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, None]:
        """Run both branches on ``x`` and add them to it.

        Args:
            x: the hidden states of the new tokens.
            memory: must be None (no cross-attention); kept for ``DecoderLayer``'s signature.
            mask: bool self-attention mask, True = may attend.
            memory_mask: unused (no cross-attention).
            bias: additive self-attention bias.
            rotary: the rotary encoding to apply to queries and keys, if any.
            positions: the new tokens' positions.
            key_positions: the positions of every key, cached ones included.
            cache: this layer's KV cache, updated in place.
            need_weights: also return the attention weights.

        Returns:
            ``(x, self-attention weights or None, None)``.

        Shapes: x ``(B, L, d_model)`` -> ``(B, L, d_model)``.
        """
        attn_out, weights = self.self_attn(
            self.self_attn_sublayer.normalize(x), mask=mask, bias=bias, is_causal=True, rotary=rotary,
            positions=positions, key_positions=key_positions, cache=None if cache is None else cache.self_attn,
            need_weights=need_weights,
        )
        ffn_out = self.ffn(self.ffn_sublayer.normalize(x))
        x = self.ffn_sublayer.residual(self.self_attn_sublayer.residual(x, attn_out), ffn_out)
        return x, weights, None


class _Builder:
    """Builds the blocks of one layer from registry names, the layer's shape and the blocks' options."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, n_kv_heads: int | None, d_head: int | None,
                 d_value: int | None, dropout: float, attention_dropout: float, ffn: str, norm: str,
                 norm_eps: float, sublayer: str, attention: str, attention_backend: str, bias: bool,
                 options: Mapping[str, Mapping[str, Any]] | None) -> None:
        options = dict(options or {})
        unknown = sorted(set(options) - set(LAYER_OPTION_KINDS))
        if unknown:
            raise ValueError(
                f"layer options name unknown block kinds {unknown}; expected some of {list(LAYER_OPTION_KINDS)}"
            )
        self.options = {kind: dict(options.get(kind) or {}) for kind in LAYER_OPTION_KINDS}
        self.d_model, self.norm_name, self.norm_eps, self.dropout = d_model, norm, norm_eps, dropout
        self.sublayer_name = sublayer
        self.attention_kwargs = dict(
            d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, d_value=d_value,
            dropout=attention_dropout, backend=attention_backend,
        )
        self.attention_name, self.ffn_name, self.d_ff, self.bias = attention, ffn, d_ff, bias

    def _build(self, kind: str, name: str, **supplied: Any) -> nn.Module:
        # Options may override the config's defaults (e.g. bias) but never the keys the builder owns.
        options = self.options[kind]
        taken = sorted(set(options) & set(SUPPLIED[kind]))
        if taken:
            raise ValueError(f"{kind} option(s) {taken} are set by the model itself, not by options")
        return build(kind, name, **{**supplied, **options})

    def attention(self) -> nn.Module:
        return self._build("attention", self.attention_name, **self.attention_kwargs, bias=self.bias)

    def ffn(self) -> nn.Module:
        return self._build("ffn", self.ffn_name, d_model=self.d_model, d_ff=self.d_ff, bias=self.bias)

    def sublayer(self, norm: str | None = None) -> nn.Module:
        # An overriding norm (``attention_norm``) is another kind: the norm options do not apply to it.
        if norm is None:
            norm_module = self._build("norm", self.norm_name, d_model=self.d_model, eps=self.norm_eps)
        else:
            norm_module = build("norm", norm, d_model=self.d_model, eps=self.norm_eps)
        return self._build("sublayer", self.sublayer_name, norm=norm_module, dropout=self.dropout)


@register("layer", "encoder")
def encoder_layer(
    d_model: int,
    n_heads: int,
    d_ff: int,
    n_kv_heads: int | None = None,
    d_head: int | None = None,
    d_value: int | None = None,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    ffn: str = "relu",
    norm: str = "layernorm",
    norm_eps: float = 1e-5,
    sublayer: str = "post_norm",
    attention: str = "mha",
    attention_backend: str = "sdpa",
    bias: bool = True,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    attention_norm: str | None = None,
) -> EncoderLayer:
    """Build an ``EncoderLayer`` from registry names (defaults: the paper's base layer).

    Args:
        d_model: the model's width.
        n_heads: attention heads.
        d_ff: the feed-forward block's inner width.
        n_kv_heads: key/value heads (default ``n_heads``; fewer is GQA/MQA).
        d_head: width of each query/key head (default ``d_model // n_heads``).
        d_value: width of each value head (default ``d_head``).
        dropout: dropout on each sublayer's output.
        attention_dropout: dropout on the attention weights.
        ffn: registered name of the feed-forward block.
        norm: registered name of the norm.
        norm_eps: the norm's epsilon.
        sublayer: registered name of the residual connection (``post_norm``, ``pre_norm``, ``sandwich_norm``).
        attention: registered name of the attention block.
        attention_backend: registered name of the attention backend.
        bias: biases in the linear layers.
        options: maps a block kind (``attention``, ``ffn``, ``norm``, ``sublayer``) to that block's keyword options.
        attention_norm: another registered norm for the attention sublayer (ModernBERT's first layer has none).

    Returns:
        The layer.
    """
    b = _Builder(d_model, n_heads, d_ff, n_kv_heads, d_head, d_value, dropout, attention_dropout, ffn, norm,
                 norm_eps, sublayer, attention, attention_backend, bias, options)
    return EncoderLayer(
        self_attn=b.attention(), ffn=b.ffn(), self_attn_sublayer=b.sublayer(attention_norm), ffn_sublayer=b.sublayer()
    )


@register("layer", "decoder")
def decoder_layer(
    d_model: int,
    n_heads: int,
    d_ff: int,
    n_kv_heads: int | None = None,
    d_head: int | None = None,
    d_value: int | None = None,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    ffn: str = "relu",
    norm: str = "layernorm",
    norm_eps: float = 1e-5,
    sublayer: str = "post_norm",
    attention: str = "mha",
    attention_backend: str = "sdpa",
    bias: bool = True,
    cross_attention: bool = True,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    attention_norm: str | None = None,
) -> DecoderLayer:
    """Build a ``DecoderLayer`` from registry names; ``cross_attention=False`` gives a decoder-only block.

    Cross-attention takes the attention options except ``window`` (it attends to the whole source). Every argument
    but ``cross_attention`` is as for ``encoder_layer``.

    Args:
        d_model: the model's width.
        n_heads: attention heads.
        d_ff: the feed-forward block's inner width.
        n_kv_heads: key/value heads (default ``n_heads``).
        d_head: width of each query/key head.
        d_value: width of each value head.
        dropout: dropout on each sublayer's output.
        attention_dropout: dropout on the attention weights.
        ffn: registered name of the feed-forward block.
        norm: registered name of the norm.
        norm_eps: the norm's epsilon.
        sublayer: registered name of the residual connection.
        attention: registered name of the attention block.
        attention_backend: registered name of the attention backend.
        bias: biases in the linear layers.
        cross_attention: add cross-attention over an encoder's memory (False: a GPT-style block).
        options: each block kind's keyword options.
        attention_norm: another registered norm for the self-attention sublayer.

    Returns:
        The layer.
    """
    b = _Builder(d_model, n_heads, d_ff, n_kv_heads, d_head, d_value, dropout, attention_dropout, ffn, norm,
                 norm_eps, sublayer, attention, attention_backend, bias, options)
    cross_attn = cross_sublayer = None
    if cross_attention:
        window = b.options["attention"].pop("window", None)
        cross_attn, cross_sublayer = b.attention(), b.sublayer()
        if window is not None:
            b.options["attention"]["window"] = window
    return DecoderLayer(
        self_attn=b.attention(), cross_attn=cross_attn, cross_attn_sublayer=cross_sublayer, ffn=b.ffn(),
        self_attn_sublayer=b.sublayer(attention_norm), ffn_sublayer=b.sublayer(),
    )


@register("layer", "parallel")
def parallel_layer(
    d_model: int,
    n_heads: int,
    d_ff: int,
    n_kv_heads: int | None = None,
    d_head: int | None = None,
    d_value: int | None = None,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    ffn: str = "gelu",
    norm: str = "layernorm",
    norm_eps: float = 1e-5,
    sublayer: str = "pre_norm",
    attention: str = "mha",
    attention_backend: str = "sdpa",
    bias: bool = True,
    cross_attention: bool = False,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    attention_norm: str | None = None,
) -> ParallelDecoderLayer:
    """Build a ``ParallelDecoderLayer`` (GPT-NeoX's ``use_parallel_residual``); decoder-only, pre-norm.

    The arguments not listed are as for ``encoder_layer``.

    Args:
        sublayer: must be ``pre_norm`` (both branches read ``x``).
        cross_attention: must be False.

    Returns:
        The layer.

    Raises:
        ValueError: ``cross_attention=True`` or a sublayer other than ``pre_norm``.
    """
    if cross_attention:
        raise ValueError("the parallel layer has no cross-attention (cross_attention=True given)")
    if sublayer != "pre_norm":
        raise ValueError(f"the parallel layer needs sublayer='pre_norm' (both branches read x), got {sublayer!r}")
    b = _Builder(d_model, n_heads, d_ff, n_kv_heads, d_head, d_value, dropout, attention_dropout, ffn, norm,
                 norm_eps, sublayer, attention, attention_backend, bias, options)
    return ParallelDecoderLayer(
        self_attn=b.attention(), ffn=b.ffn(), self_attn_sublayer=b.sublayer(attention_norm), ffn_sublayer=b.sublayer()
    )
