"""Routed gated experts (SwiGLU / GeGLU) in one autograd node: the mixture-of-experts block's fast path.

For experts of the form ``down(act(gate(x)) · up(x))`` the block's work is nine matmuls per (token, slot) pair —
gate, up and down forward; the input and weight gradients of each backward — and everything else is overhead. Left
to autograd, each expert's forward keeps ``act(gate)``, the product and the weighted output alive, and the backward
adds one node per op (plus a large gather/scatter of every pair's rows). ``GatedExperts`` runs the experts one after
the other on cache-sized groups and keeps only what the backward needs: the gate and up projections of every pair
``(S, d_ff)`` each. The backward recomputes ``act(gate) · up`` (two elementwise passes, cheaper than keeping it),
folds the routing weight into the smaller of the two activations, sums the gate and up input gradients in one
``addmm`` and skips every gradient nobody asked for (a frozen input, frozen experts, the routing weights).

Numerically it is the same formula with the routing weight applied before ``down`` (before: after it): outputs
agree with the autograd path to rounding.
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
    ``nn.Linear`` maps with ``dtype`` weights that are ordinary tensors, no hooks, no active dropout. Anything
    else (LoRA or int8 linears, tensor-parallel shards, other FFNs) keeps the autograd path."""
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
    return True


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
        experts: the routed experts.

    Returns:
        ``(N, d_model)``.
    """
    tokens = order // top_k  # (S,) the token of each sorted pair
    w = weights.reshape(-1)[order]  # (S,) its weight
    first = experts[0]
    per_group = max(1, GROUP_BYTES // (3 * first.gate_proj.weight.numel() * h.element_size()))
    bounds = range(0, len(experts), per_group)
    sizes = [sum(counts[a:a + per_group]) for a in bounds]
    out = torch.zeros_like(h)
    grad = torch.is_grad_enabled()
    for a, size, group_tokens, group_w in zip(bounds, sizes, tokens.split(sizes), w.split(sizes), strict=True):
        if size or grad:
            params = [p for e in experts[a:a + per_group]
                      for p in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)]
            out = GatedExperts.apply(out, h, group_w, group_tokens, counts[a:a + per_group], type(first), *params)
    return out


def two_rows(x: Tensor) -> Tensor:
    """``x`` ``(n, d)``, a single row repeated to two: one row would take the matrix-vector kernel, whose rounding
    depends on the weight's address (weights loaded from safetensors sit at 8-byte offsets); two rows take the matrix
    kernel, as every other group (callers keep the first ``n`` rows of the product)."""
    return x.expand(2, -1).contiguous() if x.shape[0] == 1 else x


class GatedExperts(torch.autograd.Function):
    """A group of experts: adds their weighted outputs into ``out`` in place, with a hand-written backward."""

    @staticmethod
    def forward(ctx, out: Tensor, h: Tensor, w: Tensor, tokens: Tensor, counts: list[int], kind: type,
                *params: Tensor) -> Tensor:
        act = ACTIVATIONS[kind][0]
        d_ff = params[0].shape[0]
        save = any(ctx.needs_input_grad)
        if save:
            gate, up = h.new_empty(tokens.shape[0], d_ff), h.new_empty(tokens.shape[0], d_ff)  # (S, d_ff)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            wg, wu, wd = params[3 * e:3 * e + 3]
            rows = slice(start, start + n)
            x = two_rows(h.index_select(0, tokens[rows]))  # (n, d_model)
            if save and n > 1:  # straight into the saved buffers
                g, u = torch.mm(x, wg.T, out=gate[rows]), torch.mm(x, wu.T, out=up[rows])
            else:
                g, u = (x @ wg.T)[:n], (x @ wu.T)[:n]  # (n, d_ff)
                if save:
                    gate[rows], up[rows] = g, u
            a = act(g).mul_(u)
            if d_ff <= h.shape[1]:  # the weight goes on the smaller of the two activations
                a.mul_(w[rows, None])
            y = (two_rows(a) @ wd.T)[:n]  # (n, d_model)
            if d_ff > h.shape[1]:
                y.mul_(w[rows, None])
            out.index_add_(0, tokens[rows], y)
            start += n
        ctx.mark_dirty(out)
        ctx.counts, ctx.kind = counts, kind
        if save:
            ctx.save_for_backward(h, w, tokens, gate, up, *params)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        h, w, tokens, gate, up, *params = ctx.saved_tensors
        act, act_backward = ACTIVATIONS[ctx.kind]
        need_h, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_params = ctx.needs_input_grad[6:]
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.empty_like(w) if need_w else None
        grad_params: list[Tensor | None] = [None] * len(params)
        start = 0
        for e, n in enumerate(ctx.counts):
            wg, wu, wd = params[3 * e:3 * e + 3]
            if not n:  # zero gradients, not None: data-parallel ranks reduce the same set (FSDP2)
                for i in range(3 * e, 3 * e + 3):
                    grad_params[i] = torch.zeros_like(params[i]) if need_params[i] else None
                continue
            rows = slice(start, start + n)
            idx = tokens[rows]
            gy = grad.index_select(0, idx)  # (n, d_model)
            g, u = gate[rows], up[rows]
            act_g = act(g)
            a = act_g * u  # (n, d_ff) unweighted
            t = gy @ wd  # (n, d_ff): the gradient of the weighted product, before the weight
            if need_w:
                grad_w[rows] = torch.linalg.vecdot(t, a)
            if need_params[3 * e + 2]:
                grad_params[3 * e + 2] = gy.T @ a.mul_(w[rows, None])  # (d_model, d_ff)
            da = t.mul_(w[rows, None])
            du = da * act_g
            dg = act_backward(da.mul_(u), g)
            if need_h or need_params[3 * e] or need_params[3 * e + 1]:
                x = h.index_select(0, idx)
                if need_params[3 * e]:
                    grad_params[3 * e] = dg.T @ x  # (d_ff, d_model)
                if need_params[3 * e + 1]:
                    grad_params[3 * e + 1] = du.T @ x
            if need_h:
                grad_h.index_add_(0, idx, (dg @ wg).addmm_(du, wu))
            start += n
        return (grad, grad_h, grad_w, None, None, None, *grad_params)
