"""Attention through ``torch.nn.attention.flex_attention`` with block masks.

The bool mask becomes a ``mask_mod`` (and a ``BlockMask`` that skips fully masked blocks), the
additive bias a ``score_mod``. On CUDA the kernel is compiled (where it pays); on CPU it runs eagerly.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from ..registry import register
from .common import allowed_keys, check_inputs, check_sinks, check_softcap, sink_scale, zero_empty_rows


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


@register("attention_backend", "flex")
def flex_attention_backend(
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
    """Flex attention with the zoo's mask/bias contract; same results as ``math``.

    A ``score_mod`` cannot change the softmax's denominator, so attention sinks (``sinks``, ``(H,)``) rescale the
    output afterwards with the kernel's log-sum-exp: ``out · Z / (Z + exp(sink)) = out · sigmoid(lse - sink)``.

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

    Raises:
        NotImplementedError: for ``dropout_p > 0`` (flex attention has no attention dropout).
    """
    check_inputs(q, k, v, mask, bias)
    check_softcap(softcap)
    check_sinks(sinks, q)
    if dropout_p > 0:
        raise NotImplementedError(
            f"the flex backend has no attention dropout (dropout_p={dropout_p}); "
            "use dropout_p=0 or the sdpa/math/chunked backend for training with attention dropout"
        )
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    if lk == 0 or lq == 0 or b == 0:  # nothing to attend to (or nobody asking): the contract's zero rows
        return q.new_zeros((b, h, lq, v.shape[-1]))
    allowed, has_key = allowed_keys(mask, is_causal, lq, lk, q.device)

    block_mask = None
    if allowed is not None:
        full = allowed.expand(b, h, lq, lk)
        mb = b if allowed.dim() == 4 and allowed.shape[0] != 1 else None
        mh = h if allowed.dim() == 4 and allowed.shape[1] != 1 else None

        def mask_mod(bi, hi, qi, ki):
            return full[bi, hi, qi, ki]

        block_mask = create_block_mask(mask_mod, mb, mh, lq, lk, device=q.device)

    score_mod = None
    if bias is not None or softcap is not None:
        full_bias = None if bias is None else bias.to(q.dtype).expand(b, h, lq, lk)

        def score_mod(score, bi, hi, qi, ki):
            if softcap is not None:  # (score is already scaled here)
                score = torch.tanh(score / softcap) * softcap
            return score if full_bias is None else score + full_bias[bi, hi, qi, ki]

    gqa = h != k.shape[1]
    # Fresh views keep q, k and v distinct objects: with aliased inputs (q is k is v) torch 2.13's flex
    # recompiles and fails while formatting the guard of an earlier call's mask closure (a TypeError).
    k, v = k.view_as(k), v.view_as(v)
    aux = None if sinks is None else AuxRequest(lse=True)
    if torch.compiler.is_compiling():  # already inside a compiled graph: flex is fused there
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                             return_aux=aux)
    else:
        fn = _compiled_flex() if q.is_cuda else flex_attention
        with warnings.catch_warnings():
            # Eager (uncompiled) flex on CPU is intended here: compiling pays off only on GPU.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=aux)
    if aux is not None:
        out, outputs = out
        out = out * sink_scale(outputs.lse, sinks).to(out.dtype)
    return zero_empty_rows(out, has_key)
