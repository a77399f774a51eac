"""Encoder and decoder layers, composed from injected blocks (paper §3.1, Figure 1).

A layer is built from the modules passed in; the builder functions ``encoder_layer`` and
``decoder_layer`` (registered under kind ``layer``) look the blocks up by registry name.
"""

from __future__ import annotations

from torch import Tensor, nn

from .kv_cache import LayerCache
from .positional.base import PositionalEncoding
from .registry import build, register


class EncoderLayer(nn.Module):
    """Self-attention then a feed-forward network, each wrapped in a residual sublayer connection.

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
        """Returns ``(x, self-attention weights or None)``."""
        weights: list[Tensor | None] = [None]

        def attend(h: Tensor) -> Tensor:
            out, weights[0] = self.self_attn(
                h, mask=mask, bias=bias, is_causal=is_causal, rotary=rotary, positions=positions,
                need_weights=need_weights,
            )
            return out

        x = self.self_attn_sublayer(x, attend)
        x = self.ffn_sublayer(x, self.ffn)
        return x, weights[0]


class DecoderLayer(nn.Module):
    """Masked self-attention, optional cross-attention over the encoder memory, then a feed-forward
    network, each in a residual sublayer connection (§3.1). Without ``cross_attn`` it is a GPT block.

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
        cache: LayerCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Causal self-attention (``mask`` is combined with the bottom-right causal mask).

        Returns ``(x, self-attention weights, cross-attention weights)`` (weights None unless asked).
        """
        weights: list[Tensor | None] = [None, None]

        def self_attend(h: Tensor) -> Tensor:
            out, weights[0] = self.self_attn(
                h, mask=mask, bias=bias, is_causal=True, rotary=rotary, positions=positions,
                cache=None if cache is None else cache.self_attn, need_weights=need_weights,
            )
            return out

        def cross_attend(h: Tensor) -> Tensor:
            out, weights[1] = self.cross_attn(
                h, memory, mask=memory_mask,
                cache=None if cache is None else cache.cross_attn, need_weights=need_weights,
            )
            return out

        x = self.self_attn_sublayer(x, self_attend)
        if self.cross_attn is not None:
            x = self.cross_attn_sublayer(x, cross_attend)
        x = self.ffn_sublayer(x, self.ffn)
        return x, weights[0], weights[1]


def _attention(attention: str, d_model: int, n_heads: int, n_kv_heads: int | None, d_head: int | None,
               d_value: int | None, bias: bool, attention_dropout: float, attention_backend: str) -> nn.Module:
    return build(
        "attention", attention, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
        d_value=d_value, bias=bias, dropout=attention_dropout, backend=attention_backend,
    )


def _sublayer(sublayer: str, norm: str, d_model: int, norm_eps: float, dropout: float) -> nn.Module:
    return build("sublayer", sublayer, norm=build("norm", norm, d_model=d_model, eps=norm_eps), dropout=dropout)


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
) -> EncoderLayer:
    """Build an ``EncoderLayer`` from registry names (defaults: the paper's base layer)."""
    return EncoderLayer(
        self_attn=_attention(attention, d_model, n_heads, n_kv_heads, d_head, d_value, bias,
                             attention_dropout, attention_backend),
        ffn=build("ffn", ffn, d_model=d_model, d_ff=d_ff, bias=bias),
        self_attn_sublayer=_sublayer(sublayer, norm, d_model, norm_eps, dropout),
        ffn_sublayer=_sublayer(sublayer, norm, d_model, norm_eps, dropout),
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
) -> DecoderLayer:
    """Build a ``DecoderLayer`` from registry names; ``cross_attention=False`` gives a decoder-only block."""
    cross = cross_attention or None
    return DecoderLayer(
        self_attn=_attention(attention, d_model, n_heads, n_kv_heads, d_head, d_value, bias,
                             attention_dropout, attention_backend),
        cross_attn=cross and _attention(attention, d_model, n_heads, n_kv_heads, d_head, d_value, bias,
                                        attention_dropout, attention_backend),
        cross_attn_sublayer=cross and _sublayer(sublayer, norm, d_model, norm_eps, dropout),
        ffn=build("ffn", ffn, d_model=d_model, d_ff=d_ff, bias=bias),
        self_attn_sublayer=_sublayer(sublayer, norm, d_model, norm_eps, dropout),
        ffn_sublayer=_sublayer(sublayer, norm, d_model, norm_eps, dropout),
    )
