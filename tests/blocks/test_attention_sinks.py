"""Attention sinks (gpt-oss): every backend against a float64 brute force, the attention module with caches.

A sink is a learned logit per query head that joins the softmax's denominator and carries no value. Parametrized
over ``blocks.names("attention_backend")``: a newly registered backend must take ``sinks`` too.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import blocks
from blocks.attention import MultiHeadAttention
from blocks.kv_cache import KVCache
from tests.blocks.test_backends import BACKENDS, allowed_keys, attention_cases, backend_settings, call

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py


def brute_force(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None, scale: float | None,
                sinks: Tensor) -> Tensor:
    """``Σ_j exp(s_j) v_j / (exp(sink) + Σ_j exp(s_j))`` over the allowed keys, in float64, one term at a time
    (no softmax call); a row with no allowed key is zero."""
    h, hkv = q.shape[1], k.shape[1]
    kv_head = torch.arange(h) // (h // hkv)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()[:, kv_head]) * scale
    if bias is not None:
        scores = scores + bias.double()
    sink = sinks.double()[None, :, None, None]
    top = torch.maximum(scores.masked_fill(~allowed, -math.inf).amax(-1, keepdim=True), sink)
    e = torch.exp(scores - top) * allowed
    out = (e @ v.double()[:, kv_head]) / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
    return (out * allowed.any(-1, keepdim=True)).float()


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_equals_the_brute_force(name: str) -> None:
    """Hypothesis over shapes (MHA, GQA, MQA), masks (with empty rows), biases, causal, scales and sink logits."""

    @backend_settings(name, 12)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        case = data.draw(attention_cases())
        shape = case["shape"]
        sinks = torch.tensor(data.draw(st.lists(st.floats(-4.0, 4.0), min_size=shape.h, max_size=shape.h)))
        allowed = allowed_keys(shape, case["mask"], case["is_causal"])
        expected = brute_force(case["q"], case["k"], case["v"], allowed, case["bias"], case["scale"], sinks)
        with torch.no_grad():
            out = call(name, case["q"], case["k"], case["v"], mask=case["mask"], bias=case["bias"],
                       is_causal=case["is_causal"], scale=case["scale"], sinks=sinks.float())
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)

    check()


@pytest.mark.parametrize("block_size", [1, 3])
def test_chunked_with_small_blocks_and_a_window_mask(block_size: int) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    sinks = torch.randn(6) * 2
    i = torch.arange(9)
    window = (i[:, None] - i[None, :]).abs() < 3  # a sliding window of 3
    allowed = window & (i[None, :] <= i[:, None])
    expected = brute_force(q, k, v, allowed.expand(2, 6, 9, 9), None, None, sinks)
    out = blocks.get("attention_backend", "chunked")(q, k, v, mask=window, is_causal=True, sinks=sinks,
                                                     block_size=block_size)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["sdpa", "chunked"])
def test_gradients_equal_math(name: str) -> None:
    """The sink logits train: their gradient (and the queries') equal the reference backend's."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    sinks = torch.randn(4, requires_grad=True)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    grads = []
    for backend in ("math", name):
        out = blocks.get("attention_backend", backend)(q, k, v, mask=mask, is_causal=True, sinks=sinks)
        grads.append(torch.autograd.grad(out.square().sum(), (q, sinks)))
    for ref, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert grads[0][1].abs().sum() > 0


def test_math_weights_leave_the_sinks_share_out() -> None:
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    sinks = torch.tensor([0.0, 3.0])
    out, weights = blocks.get("attention_backend", "math")(q, k, v, sinks=sinks, return_weights=True)
    torch.testing.assert_close(out, weights @ v)
    assert (weights.sum(-1) < 1).all() and (weights.sum(-1)[:, 1] < weights.sum(-1)[:, 0]).all()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(1, 4), torch.zeros(4, dtype=torch.long), [0.0] * 4])
def test_sink_logits_of_the_wrong_shape_are_refused_by_name(name: str, bad: object) -> None:
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"sinks must be a floating tensor of shape \(H,\)=\(4,\)"):
        blocks.get("attention_backend", name)(q, q, q, sinks=bad)


# ----------------------------------------------------------------------------------------------------------
# the attention module: a parameter, cached decoding equal to the full forward
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "window"), [(name, 4) for name in BACKENDS] + [("sdpa", None)])
@torch.no_grad()
def test_module_with_sinks_decodes_with_a_cache_as_the_full_forward(name: str, window: int | None) -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(24, 6, n_kv_heads=2, sinks=True, window=window, backend=name).eval()
    assert attn.sinks.shape == (6,) and "sinks" in dict(attn.named_parameters())
    attn.sinks.normal_(0, 2)
    x = torch.randn(2, 9, 24)
    positions = torch.arange(9).expand(2, 9)
    full, _ = attn(x, is_causal=True, positions=positions)
    reference = MultiHeadAttention(24, 6, n_kv_heads=2, sinks=True, window=window, backend="math").eval()
    reference.load_state_dict(attn.state_dict())
    torch.testing.assert_close(full, reference(x, is_causal=True, positions=positions)[0], atol=1e-5, rtol=1e-5)
    without = MultiHeadAttention(24, 6, n_kv_heads=2, window=window, backend=name).eval()
    without.load_state_dict({k: t for k, t in attn.state_dict().items() if k != "sinks"})
    assert not torch.allclose(full, without(x, is_causal=True, positions=positions)[0], atol=1e-3)
    cache = KVCache(max_len=9)
    steps = [attn(x[:, :5], is_causal=True, positions=positions[:, :5], cache=cache)[0]]
    for t in range(5, 9):
        steps.append(attn(x[:, t:t + 1], is_causal=True, positions=positions[:, t:t + 1],
                          key_positions=positions[:, :t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_module_without_sinks_has_no_parameter() -> None:
    assert MultiHeadAttention(16, 4).sinks is None
