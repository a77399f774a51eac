"""The MoE block's fast path (``blocks/gated_experts.py``): its hand-written backward against autograd's, and when it
is taken."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import blocks
import blocks.gated_experts as gated
import blocks.moe as moe_module
from blocks.ffn import GeGLUFFN, GeGLUTanhFFN, SwiGLUFFN
from blocks.gated_experts import GatedExperts, fast_experts
from blocks.quantized import quantize_linears

KINDS = [SwiGLUFFN, GeGLUFFN, GeGLUTanhFFN]


@pytest.mark.parametrize(("d", "f"), [(4, 3), (3, 5)], ids=["weight-on-d_ff", "weight-on-d_model"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_the_backward_passes_gradcheck_in_float64(kind: type, d: int, f: int) -> None:
    """Expert 0 gets three rows, expert 1 one (the two-row path), expert 2 none (zero gradients); the routing weight
    goes on the smaller activation (d_ff or d_model), both cases covered."""
    gen = torch.Generator().manual_seed(0)
    n = 4
    h = torch.randn(n, d, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(n, dtype=torch.float64, generator=gen, requires_grad=True)
    tokens, counts = torch.tensor([0, 2, 3, 1]), [3, 1, 0]
    params = [torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
              for _ in counts for shape in ((f, d), (f, d), (d, f))]

    def run(h, w, *params):
        return GatedExperts.apply(torch.zeros_like(h), h.index_select(0, tokens), w, tokens, counts, kind, *params)

    assert torch.autograd.gradcheck(run, (h, w, *params))
    # ... and equals autograd through the plain formula.
    expected = torch.zeros_like(h)
    act = kind(d, f).activation
    for e, n in enumerate(counts):
        rows = slice(sum(counts[:e]), sum(counts[:e]) + n)
        wg, wu, wd = params[3 * e:3 * e + 3]
        x = h[tokens[rows]]
        y = (act(x @ wg.T) * (x @ wu.T)) @ wd.T * w[rows, None]
        expected = expected.index_add(0, tokens[rows], y)
    out = run(h, w, *params)
    torch.testing.assert_close(out, expected)
    probe = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((out * probe).sum(), (h, w, *params))
    want = torch.autograd.grad((expected * probe).sum(), (h, w, *params), allow_unused=True)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(g) if e is None else e)


def both_paths(moe: nn.Module, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    """Output and gradients (input, router, experts) of the fast path and of the autograd path."""
    results = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(moe_module, "fast_experts", lambda *args: False)
        moe.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(x.requires_grad)
        out = moe(leaf)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out, *(() if leaf.grad is None else (leaf.grad,)),
                        *(p.grad for p in moe.parameters() if p.grad is not None)])
    return results


@pytest.mark.parametrize("group_bytes", [1, gated.GROUP_BYTES], ids=["one-expert-per-node", "default-groups"])
@pytest.mark.parametrize(("expert", "d_ff"), [("swiglu", 12), ("geglu_tanh", 6)])
def test_the_fast_path_equals_autograd_through_the_experts(expert: str, d_ff: int, group_bytes: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gated, "GROUP_BYTES", group_bytes)
    torch.manual_seed(0)
    moe = blocks.build("ffn", "moe", d_model=8, d_ff=d_ff, n_experts=7, top_k=3, expert=expert, d_shared=5,
                       shared_gate=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    assert fast_experts(moe.experts, x.dtype)
    fast, slow = both_paths(moe, x, monkeypatch)
    assert len(fast) == len(slow) == 2 + len(list(moe.parameters()))  # output, input, every parameter
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_frozen_inputs_and_experts_get_no_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    moe = blocks.build("ffn", "moe", d_model=8, d_ff=6, n_experts=4, top_k=2)
    for expert in moe.experts[:2]:
        expert.requires_grad_(False)
    x = torch.randn(9, 8)  # no gradient wanted for the input
    fast, slow = both_paths(moe, x, monkeypatch)
    assert len(fast) == len(slow) == 1 + 1 + 3 * 2  # output, router, the two trainable experts
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(p.grad is None for expert in moe.experts[:2] for p in expert.parameters())


def test_other_experts_keep_the_autograd_path() -> None:
    def experts(expert: str = "swiglu", **options) -> nn.ModuleList:
        return blocks.build("ffn", "moe", d_model=8, d_ff=4, n_experts=2, expert=expert, **options).experts

    assert fast_experts(experts(), torch.float32)
    assert not fast_experts(experts(), torch.float64)  # weights of another dtype than the tokens
    assert not fast_experts(experts("gelu"), torch.float32)  # not gated
    assert not fast_experts(experts("clamped_swiglu"), torch.float32)  # clamps
    assert not fast_experts(experts(bias=True), torch.float32)
    assert not fast_experts(experts(dropout=0.1), torch.float32)  # training mode with dropout
    assert fast_experts(experts(dropout=0.1).eval(), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fast_experts(experts(), torch.float32)
    hooked = experts()
    hooked[1].down_proj.register_forward_hook(lambda *args: None)
    assert not fast_experts(hooked, torch.float32)
    wrapped = experts()
    wrapped[0].up_proj = nn.Sequential(wrapped[0].up_proj)  # e.g. an adapter around a linear
    assert not fast_experts(wrapped, torch.float32)
    assert not fast_experts(quantize_linears(experts()), torch.float32)  # int8 linears have no float weight
