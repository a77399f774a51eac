"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` (flash, memory-efficient
or math kernels, chosen by PyTorch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register
from .common import additive_mask, allowed_keys, check_inputs, check_sinks, zero_empty_rows
from .math import math_attention


@register("attention_backend", "sdpa")
def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Scaled dot-product attention by PyTorch's fused kernels; same contract as ``math``.

    SDPA's own ``is_causal`` is aligned top-left, so it is used only when ``Lq == Lk`` and nothing else
    is masked (which lets PyTorch pick the flash kernel); otherwise the bottom-right causal mask is built.

    Attention sinks (``sinks``, ``(H,)``) become one more key: a zero key and a zero value whose additive mask is
    the head's sink logit, so the fused kernel adds ``exp(sink)`` to the denominator and nothing to the output.

    Args:
        q: queries; ``H % Hkv == 0`` (GQA/MQA share key/value heads).
        k: keys.
        v: values.
        mask: bool, True = may attend, broadcastable to ``(B, H, Lq, Lk)``.
        bias: additive float bias (ALiBi, relative positions), broadcastable to ``(B, H, Lq, Lk)``.
        is_causal: apply a bottom-right aligned causal mask.
        dropout_p: dropout on the attention weights.
        scale: score scale, default ``1 / sqrt(D)``.
        softcap: if set, scaled scores become ``softcap · tanh(score / softcap)`` before bias and mask.
        sinks: ``(H,)`` attention-sink logits (see ``math``).

    Returns:
        The output; query rows with no allowed key give zeros.

    Shapes: q ``(B, H, Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)`` -> ``(B, H, Lq, Dv)``.
    """
    check_inputs(q, k, v, mask, bias)
    check_sinks(sinks, q)
    if softcap is not None or (sinks is not None and q.shape[2] == 1 and not q.is_cuda):
        # PyTorch's fused kernels cannot transform the scores before the softmax: compute it explicitly.
        # (So does a sink model's decoding step on the CPU, for the reason given below.)
        return math_attention(q, k, v, mask=mask, bias=bias, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
                              softcap=softcap, sinks=sinks)
    lq, lk = q.shape[2], k.shape[2]
    # One query (a decoding step) sees every key under the bottom-right causal mask: nothing to mask.
    is_causal = is_causal and lq > 1
    if lq == 1 and not q.is_cuda:
        # PyTorch's CPU flash kernel spends milliseconds of setup on a single query (measured: ~8 ms against
        # ~0.1 ms for the explicit product at 8 heads × 64 keys), so decoding steps use the formula directly.
        return math_attention(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p, scale=scale)
    gqa = q.shape[1] != k.shape[1]
    if sinks is not None:
        return _with_sink_key(q, k, v, mask, bias, is_causal, dropout_p, scale, sinks)
    if mask is None and bias is None and (not is_causal or lq == lk):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    allowed, has_key = allowed_keys(mask, is_causal, lq, lk, q.device)
    attn_mask: Tensor | None = allowed
    if bias is not None:
        attn_mask = bias.to(q.dtype) if allowed is None else bias.to(q.dtype) + additive_mask(allowed, q.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return zero_empty_rows(out, has_key)


def _with_sink_key(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, is_causal: bool,
                   dropout_p: float, scale: float | None, sinks: Tensor) -> Tensor:
    """SDPA over the keys plus a sink key (zero key, zero value, additive mask = the head's sink logit)."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    allowed, has_key = allowed_keys(mask, is_causal, lq, lk, q.device)
    scores_bias = q.new_zeros((1, 1, 1, lk)) if allowed is None else additive_mask(allowed, q.dtype)
    if bias is not None:
        scores_bias = scores_bias + bias.to(q.dtype)
    shape = (1,) * (4 - scores_bias.dim()) + tuple(scores_bias.shape)
    scores_bias = scores_bias.reshape(shape).expand(shape[0], h, shape[2], lk)
    sink = sinks.to(q.dtype)[None, :, None, None].expand(*scores_bias.shape[:-1], 1)
    attn_mask = torch.cat([scores_bias, sink], dim=-1)  # (B or 1, H, Lq or 1, Lk + 1)
    k = torch.cat([k, k.new_zeros((b, k.shape[1], 1, k.shape[3]))], dim=2)
    v = torch.cat([v, v.new_zeros((b, v.shape[1], 1, v.shape[3]))], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=h != k.shape[1])
    return zero_empty_rows(out, has_key)
