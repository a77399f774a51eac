"""MultiHeadAttention projects q, k, v with one fused matmul; results equal separate projections."""

from __future__ import annotations

import torch
from torch import nn

from blocks import MultiHeadAttention


def separate(m: MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
    """Reference attention output with the three projections applied one by one."""
    src = x if context is None else context
    b, lq, _ = x.shape
    q = m.q_proj(x).view(b, lq, m.n_heads, -1).transpose(1, 2)
    k = m.k_proj(src).view(b, src.shape[1], m.n_kv_heads, -1).transpose(1, 2)
    v = m.v_proj(src).view(b, src.shape[1], m.n_kv_heads, -1).transpose(1, 2)
    k = k.repeat_interleave(m.n_heads // m.n_kv_heads, dim=1)
    v = v.repeat_interleave(m.n_heads // m.n_kv_heads, dim=1)
    out = torch.softmax(q @ k.transpose(-2, -1) / m.d_head**0.5, dim=-1) @ v
    return m.o_proj(out.transpose(1, 2).reshape(b, lq, -1))


def test_fused_self_and_cross_attention_equal_separate_projections():
    m = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2, d_value=6, d_context=12).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 12)
    self_m = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2).eval()
    torch.testing.assert_close(self_m(x)[0], separate(self_m, x))
    torch.testing.assert_close(m(x, memory)[0], separate(m, x, memory))


def test_gradients_reach_each_projection():
    m = MultiHeadAttention(d_model=8, n_heads=2)
    m(torch.randn(1, 3, 8))[0].sum().backward()
    for proj in (m.q_proj, m.k_proj, m.v_proj):
        assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0


def test_training_and_inference_paths_agree_and_follow_weight_edits():
    m = MultiHeadAttention(d_model=8, n_heads=2).eval()
    x = torch.randn(1, 3, 8)
    fused = m(x)[0]  # grad enabled: the fused matmul
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0], fused)  # separate projections
        m.v_proj.weight.data.mul_(2.0)  # an edit through .data (no version bump) must be seen
        torch.testing.assert_close(m(x)[0], separate(m, x))
    torch.testing.assert_close(m(x)[0], separate(m, x))
    assert not torch.allclose(m(x)[0], fused)


def test_replaced_or_hooked_projections_are_called():
    class Scaled(nn.Module):
        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.inner = inner
            self.out_features = inner.out_features

        def forward(self, x):
            return 3 * self.inner(x)

    m = MultiHeadAttention(d_model=8, n_heads=2).eval()
    x = torch.randn(1, 3, 8)
    calls = []
    m.q_proj.register_forward_hook(lambda *_: calls.append("q"))
    m(x)
    assert calls == ["q"]
    m.k_proj = Scaled(m.k_proj)
    torch.testing.assert_close(m(x)[0], separate(m, x))
