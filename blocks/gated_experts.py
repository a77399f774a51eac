"""Routed gated experts (SwiGLU / GeGLU) with a hand-written backward: the mixture-of-experts block's fast path.

For experts of the form ``down(act(gate(x)) · up(x))`` the block's work is nine matmuls per (token, slot) pair —
gate, up and down forward; the input and weight gradients of each backward — and everything else is overhead.
``GatedExperts`` runs a group of experts as one autograd node: only the products run per expert (into views of
buffers shared by the group); the elementwise steps run once over the group's pairs, and the gather and scatter once
over all pairs, so an expert costs its products and a few views, not a dozen autograd nodes. The backward
reuses the forward's activations (``act(gate)`` and the product), applies the routing weight to the smaller of the two
sides (``d_ff`` or ``d_model``), sums the gate and up input gradients in one ``addmm`` and skips every gradient nobody
asked for (a frozen input, frozen experts, the routing weights).

Groups hold at most ``GROUP_BYTES`` of weight gradients: autograd accumulates (and frees) a node's gradients before
the next node's backward, so one group's memory is reused by the next instead of every step faulting in fresh pages
for all experts' gradients at once (~96 MiB, ~25,000 page faults a step at 64 experts of 256 × 512 when the whole
layer was one node). Numerically it is the same formula with the routing weight applied before ``down`` when
``d_ff <= d_model`` (after it otherwise): outputs agree with the autograd path to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .ffn import GatedFeedForward, GeGLUFFN, GeGLUTanhFFN, SwiGLUFFN

#: expert class -> (activation, its derivative given the upstream gradient and the input).
ACTIVATIONS: dict[type, tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    SwiGLUFFN: (F.silu, torch.ops.aten.silu_backward),
    GeGLUFFN: (F.gelu, lambda grad, x: torch.ops.aten.gelu_backward(grad, x)),
    GeGLUTanhFFN: (lambda x: F.gelu(x, approximate="tanh"),
                   lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate="tanh")),
}


def fast_experts(experts: Sequence[nn.Module], dtype: torch.dtype) -> bool:
    """Whether ``experts`` can run as ``GatedExperts``: all plain SwiGLU/GeGLU blocks (exact classes) of bias-free
    ``nn.Linear`` maps with ``dtype`` weights that are ordinary tensors, no hooks, no active dropout, no autocast.
    Anything else (LoRA or int8 linears, tensor-parallel shards, other FFNs) keeps the autograd path.

    Args:
        experts: the routed experts.
        dtype: the activations' dtype.

    Returns:
        True when the fast path applies.
    """
    if not experts or type(experts[0]) not in ACTIVATIONS:
        return False
    kind = type(experts[0])
    for expert in experts:
        if type(expert) is not kind or expert._forward_hooks or expert._forward_pre_hooks:
            return False
        if expert.training and expert.dropout.p > 0:
            return False
        for linear in (expert.gate_proj, expert.up_proj, expert.down_proj):
            if type(linear) is not nn.Linear or linear.bias is not None or linear._forward_hooks \
                    or linear._forward_pre_hooks:
                return False
            weight = linear.weight
            if type(weight) not in (Tensor, nn.Parameter) or weight.dtype != dtype:
                return False
    # Checked once every linear is known to be an ``nn.Linear`` (an int8 linear has no ``weight``): autocast's
    # casts are autograd's business.
    return not torch.is_autocast_enabled(experts[0].gate_proj.weight.device.type)


#: weight-gradient bytes one autograd node returns at most: each node's gradients are accumulated (and freed) before
#: the next node's backward, so their memory is reused instead of faulted in fresh each step.
GROUP_BYTES = 8 * 2**20


def gated_experts(h: Tensor, weights: Tensor, order: Tensor, counts: list[int], top_k: int,
                  experts: Sequence[GatedFeedForward]) -> Tensor:
    """``Σ_slots weight · expert(h)`` for every token through its chosen experts (``fast_experts`` must hold).

    Args:
        h: ``(N, d_model)`` tokens.
        weights: ``(N, top_k)`` routing weights.
        order: ``(N · top_k,)`` the (token, slot) pairs sorted by expert (stable), as flat indices.
        counts: pairs per expert (``len(experts)`` entries summing to ``N · top_k``).
        top_k: experts per token (the pair ``i`` belongs to token ``i // top_k``).
        experts: the routed experts.

    Returns:
        ``(N, d_model)``.

    Shapes: h ``(N, d_model)``, weights ``(N, top_k)``, order ``(N · top_k,)`` -> ``(N, d_model)``.
    """
    tokens = order // top_k  # (S,) the token of each sorted pair
    w = weights.reshape(-1)[order]  # (S,) its weight
    x = h.index_select(0, tokens)  # (S, d_model) its row: one gather (and one scatter back) for every group
    first = experts[0]
    per_group = max(1, GROUP_BYTES // (3 * first.gate_proj.weight.numel() * h.element_size()))
    bounds = range(0, len(experts), per_group)
    sizes = [sum(counts[a:a + per_group]) for a in bounds]
    out = torch.zeros_like(h)
    grad = torch.is_grad_enabled()
    for a, size, group_tokens, group_x, group_w in zip(bounds, sizes, tokens.split(sizes), x.split(sizes),
                                                       w.split(sizes), strict=True):
        if size or grad:
            params = [p for e in experts[a:a + per_group]
                      for p in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)]
            out = GatedExperts.apply(out, group_x, group_w, group_tokens, counts[a:a + per_group], type(first),
                                     *params)
    return out


def two_rows(x: Tensor) -> Tensor:
    """``x`` ``(n, d)``, a single row repeated to two: one row would take the matrix-vector kernel, whose rounding
    depends on the weight's address (weights loaded from safetensors sit at 8-byte offsets); two rows take the matrix
    kernel, as every other group (callers keep the first ``n`` rows of the product).

    Args:
        x: an expert's rows.

    Returns:
        ``x``, or its single row twice.

    Shapes: ``(n, d)`` -> ``(max(n, 2), d)``.
    """
    return x.expand(2, -1).contiguous() if x.shape[0] == 1 else x


def _project(x: Tensor, weight: Tensor, into: Tensor) -> None:
    """``into = x @ weight`` for one expert's rows (a single row through the matrix kernel, see ``two_rows``)."""
    if x.shape[0] == 1:
        into.copy_((two_rows(x) @ weight)[:1])
    else:
        torch.mm(x, weight, out=into)


class GatedExperts(torch.autograd.Function):
    """A group of experts: adds their weighted outputs into ``out`` in place, with a hand-written backward.

    Only the products run per expert; gathers, scatters and elementwise steps run once over the group's pairs.
    """

    @staticmethod
    def forward(ctx, out: Tensor, x: Tensor, w: Tensor, tokens: Tensor, counts: list[int], kind: type,
                *params: Tensor) -> Tensor:
        """Add the group's weighted outputs into ``out``.

        Args:
            out: the layer's output, added into in place.
            x: the group's pairs' rows, sorted by expert.
            w: their routing weights.
            tokens: their tokens.
            counts: pairs per expert.
            kind: the experts' class (SwiGLU or GeGLU).
            *params: each expert's gate, up and down weights.

        Returns:
            ``out``.

        Shapes: out ``(N, d_model)``, x ``(S, d_model)``, w and tokens ``(S,)`` -> ``(N, d_model)``.
        """
        act = ACTIVATIONS[kind][0]
        pairs, d_ff, d_model = tokens.shape[0], params[0].shape[0], x.shape[1]
        used = [e for e, n in enumerate(counts) if n]
        gate, up = x.new_empty(pairs, d_ff), x.new_empty(pairs, d_ff)
        xs, gates, ups = x.split(counts), gate.split(counts), up.split(counts)
        for e in used:
            _project(xs[e], params[3 * e].T, gates[e])
            _project(xs[e], params[3 * e + 1].T, ups[e])
        act_gate = act(gate)
        a = act_gate * up  # (S, d_ff) unweighted
        save = any(ctx.needs_input_grad)
        weight_after = d_ff > d_model  # the routing weight goes on the smaller of the two activations
        weighted = a if weight_after else a * w[:, None]
        y = x.new_empty(pairs, d_model)
        ws, ys = weighted.split(counts), y.split(counts)
        for e in used:
            _project(ws[e], params[3 * e + 2].T, ys[e])
        if weight_after:
            out.index_add_(0, tokens, y * w[:, None] if save else y.mul_(w[:, None]))
        else:
            out.index_add_(0, tokens, y)
        ctx.mark_dirty(out)
        ctx.counts, ctx.kind = counts, kind
        if save:  # y unweighted: the weight's gradient when it went on y
            ctx.save_for_backward(x, w, tokens, gate, up, act_gate, a, y if weight_after else None, *params)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w, tokens, gate, up, act_gate, a, y, *params = ctx.saved_tensors
        counts = ctx.counts
        need_x, need_w, need_params = ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[6:]
        used = [e for e, n in enumerate(counts) if n]
        grad_params: list[Tensor | None] = [
            None if not need or counts[i // 3] else torch.zeros_like(p)  # zero, not None, for an unused expert:
            for i, (p, need) in enumerate(zip(params, need_params, strict=True))  # ranks reduce the same set (FSDP2)
        ]
        gy = grad.index_select(0, tokens)  # (S, d_model)
        da = torch.empty_like(gate)  # the gradient of the product act(gate) · up
        gys, das = gy.split(counts), da.split(counts)
        if y is not None:  # the weight went on y: the weight's gradient on the d_model side, then weight gy
            grad_w = torch.linalg.vecdot(gy, y) if need_w else None
            gy.mul_(w[:, None])
            weighted = a
        for e in used:
            torch.mm(gys[e], params[3 * e + 2], out=das[e])
        if y is None:  # the weight went on a: its gradient on the d_ff side
            grad_w = torch.linalg.vecdot(da, a) if need_w else None
            da.mul_(w[:, None])
            weighted = a * w[:, None]
        du = da * act_gate
        dg = ACTIVATIONS[ctx.kind][1](da.mul_(up), gate)
        grad_x = torch.empty_like(x) if need_x else None
        xs, ws, dgs, dus = x.split(counts), weighted.split(counts), dg.split(counts), du.split(counts)
        grad_xs = grad_x.split(counts) if need_x else None
        for e in used:
            if need_params[3 * e]:
                grad_params[3 * e] = dgs[e].T @ xs[e]  # (d_ff, d_model)
            if need_params[3 * e + 1]:
                grad_params[3 * e + 1] = dus[e].T @ xs[e]
            if need_params[3 * e + 2]:
                grad_params[3 * e + 2] = gys[e].T @ ws[e]  # (d_model, d_ff)
            if need_x:
                torch.mm(dgs[e], params[3 * e], out=grad_xs[e]).addmm_(dus[e], params[3 * e + 1])
        return (grad, grad_x, grad_w, None, None, None, *grad_params)
