"""Memory-efficient attention in plain PyTorch: an online softmax over blocks of keys.

Peak memory is ``O(Lq · block_size)`` per head instead of ``O(Lq · Lk)`` (Rabe & Staats 2021,
"Self-attention does not need O(n²) memory"; the same recurrence as FlashAttention). The causal mask
is generated per block, never materialised whole. The backend for long sequences where the others
run out of memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register
from .common import check_inputs, check_sinks, check_softcap, default_scale, repeat_kv, soft_cap

DEFAULT_BLOCK_SIZE = 512


def _key_slice(t: Tensor | None, start: int, end: int) -> Tensor | None:
    """Slice a broadcastable mask/bias along the key axis (a size-1 key axis broadcasts as is)."""
    if t is None or t.shape[-1] == 1:
        return t
    return t[..., start:end]


@register("attention_backend", "chunked")
def chunked_attention(
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
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Tensor:
    """Attention by an online softmax over key blocks of ``block_size``; same contract as ``math``.

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
        block_size: keys per block (memory is ``O(Lq · block_size)`` per head).

    Returns:
        The output; query rows with no allowed key give zeros.

    Shapes: q ``(B, H, Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)`` -> ``(B, H, Lq, Dv)``.

    Raises:
        ValueError: bad shapes (see ``math``) or ``block_size < 1``.
    """
    check_inputs(q, k, v, mask, bias)
    check_softcap(softcap)
    check_sinks(sinks, q)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    n_rep = h // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, Lk, D)
    q = q * default_scale(q, scale)
    row_max = q.new_full((b, h, lq, 1), float("-inf"))
    denom = q.new_zeros((b, h, lq, 1))
    if sinks is not None:  # the sink starts the online softmax: a first "key" with score sink and no value
        row_max = sinks.to(q.dtype)[None, :, None, None].expand(b, h, lq, 1)
        denom = q.new_ones((b, h, lq, 1))
    acc = q.new_zeros((b, h, lq, v.shape[-1]))
    query_pos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    for start in range(0, lk, block_size):
        end = min(start + block_size, lk)
        scores = soft_cap(q @ k[:, :, start:end].transpose(-2, -1), softcap)  # (B, H, Lq, blk)
        block_bias = _key_slice(bias, start, end)
        if block_bias is not None:
            scores = scores + block_bias.to(scores.dtype)  # (an fp32 ALiBi bias must not upcast bf16 scores)
        allowed = _key_slice(mask, start, end)
        if is_causal:
            causal = torch.arange(start, end, device=q.device)[None, :] <= query_pos  # (Lq, blk)
            allowed = causal if allowed is None else allowed & causal
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
        # A row that has seen only masked keys keeps max -inf; shift by 0 there so exp gives 0, not NaN.
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(scores - shift)  # (B, H, Lq, blk)
        correction = torch.exp(row_max - shift)
        denom = denom * correction + p.sum(dim=-1, keepdim=True)
        if dropout_p > 0:
            # Dropping unnormalised weights (numerator only) equals dropout on the normalised ones.
            p = F.dropout(p, p=dropout_p)
        acc = acc * correction + p @ v[:, :, start:end]
        row_max = new_max
    # Rows with no allowed key have denom 0: return zeros for them.
    return acc / torch.where(denom > 0, denom, torch.ones_like(denom))
