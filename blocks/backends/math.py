"""The reference attention backend, written like the paper (§3.2.1):
``Attention(Q, K, V) = softmax(Q Kᵀ / sqrt(d_k)) V``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register
from .common import (
    additive_mask,
    allowed_keys,
    check_inputs,
    check_sinks,
    check_softcap,
    default_scale,
    repeat_kv,
    soft_cap,
    zero_empty_rows,
)


@register("attention_backend", "math")
def math_attention(
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
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention computed explicitly, optionally returning the weights.

    Args:
        q: queries ``(B, H, Lq, D)``; ``H % Hkv == 0`` (GQA/MQA share key/value heads).
        k: keys ``(B, Hkv, Lk, D)``.
        v: values ``(B, Hkv, Lk, D)``.
        mask: bool, True = may attend, broadcastable to ``(B, H, Lq, Lk)``.
        bias: additive float bias (ALiBi, relative positions), broadcastable to ``(B, H, Lq, Lk)``.
        is_causal: apply a bottom-right aligned causal mask.
        dropout_p: dropout on the attention weights.
        scale: score scale, default ``1 / sqrt(D)``.
        softcap: if set, scaled scores become ``softcap · tanh(score / softcap)`` before bias and mask.
        sinks: ``(H,)`` attention-sink logits (gpt-oss): each head's softmax denominator gains ``exp(sink)``, a key
            that is attended but carries no value, so a head can attend to nothing.
        return_weights: also return the attention weights ``(B, H, Lq, Lk)``.

    Returns:
        The output ``(B, H, Lq, Dv)``, and the weights when ``return_weights``. Query rows with no
        allowed key give zero output and zero weights. With sinks the weights of a row sum to less than 1.

    Shapes: q ``(B, H, Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)``.
    """
    check_inputs(q, k, v, mask, bias)
    check_softcap(softcap)
    check_sinks(sinks, q)
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, Lk, D)
    scores = soft_cap((q @ k.transpose(-2, -1)) * default_scale(q, scale), softcap)  # (B, H, Lq, Lk)
    if bias is not None:
        scores = scores + bias
    allowed, has_key = allowed_keys(mask, is_causal, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        scores = scores + additive_mask(allowed, scores.dtype)
    if sinks is None:
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:  # the sink is one more column of the softmax, dropped after it
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    weights = zero_empty_rows(weights, has_key)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped @ v  # (B, H, Lq, Dv)
    return (out, weights) if return_weights else out
