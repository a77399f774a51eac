"""Attention backends: every registered backend against ``math``, and ``math`` against a float64 reference.

Parametrized over ``blocks.names("attention_backend")``, so a newly registered backend is tested automatically.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import blocks
from tests import strategies as zst

BACKENDS = blocks.names("attention_backend")
TOL = {"atol": 1e-5, "rtol": 1e-5}
scales = st.one_of(st.none(), st.floats(0.05, 2.0))

#: Eager flex attention on CPU re-traces with dynamo for every new shape pattern (~0.3 s an example), so it
#: gets a fraction of the examples; every backend still runs every property.
EXAMPLE_FRACTION = {"flex": 0.3}


def backend_settings(name: str, max_examples: int | None = None) -> settings:
    """Hypothesis settings for a per-backend property (the profile's ``max_examples`` unless given)."""
    n = settings.default.max_examples if max_examples is None else max_examples
    return settings(max_examples=max(2, round(n * EXAMPLE_FRACTION.get(name, 1.0))))


def backend(name: str):  # noqa: ANN201
    return blocks.get("attention_backend", name)


def math_attention(*args, **kwargs) -> Tensor:  # noqa: ANN002, ANN003
    return backend("math")(*args, **kwargs)


def allowed_keys(shape: zst.AttentionShape, mask: Tensor | None, is_causal: bool) -> Tensor:
    """``(B, H, Lq, Lk)`` bool: which keys each query may attend, from the contract's definitions."""
    allowed = torch.ones(shape.scores, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if is_causal:
        i = torch.arange(shape.lq)[:, None]
        j = torch.arange(shape.lk)[None, :]
        allowed = allowed & (j <= i + shape.lk - shape.lq)
    return allowed


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, bias: Tensor | None, scale: float | None
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + bias) v in float64; query head h uses key/value head h // (H / Hkv)."""
    h, hkv = q.shape[1], k.shape[1]
    kv_head = torch.arange(h) // (h // hkv)
    k64, v64 = k.double()[:, kv_head], v.double()[:, kv_head]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k64) * scale
    if bias is not None:
        scores = scores + bias.double()
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # rows with no allowed key
    return (weights @ v64).float(), weights.float()


def call(name: str, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:  # noqa: ANN003
    """Call a backend; skip if it has no autograd on this device (flex on CPU) and grads are needed."""
    try:
        return backend(name)(q, k, v, **kwargs)
    except NotImplementedError as err:
        if q.requires_grad and "backward" in str(err):
            pytest.skip(f"{name}: {err}")
        raise


@st.composite
def attention_cases(draw: st.DrawFn, lengths: str = "any") -> dict:
    shape = draw(zst.attention_shapes(lengths=lengths))
    q, k, v = draw(zst.qkv(shape))
    return {
        "shape": shape,
        "q": q,
        "k": k,
        "v": v,
        "mask": draw(zst.attention_masks(shape.b, shape.h, shape.lq, shape.lk)),
        "bias": draw(zst.attention_biases(shape.b, shape.h, shape.lq, shape.lk)),
        "is_causal": draw(st.booleans()),
        "scale": draw(scales),
    }


def assert_empty_rows_are_zero(out: Tensor, allowed: Tensor) -> None:
    empty = ~allowed.any(dim=-1)  # (B, H, Lq)
    assert not out.isnan().any()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


# ----------------------------------------------------------------------------------------------------------
# math against the float64 reference
# ----------------------------------------------------------------------------------------------------------


@given(case=attention_cases())
def test_math_matches_float64_reference(case: dict) -> None:
    s = case["shape"]
    allowed = allowed_keys(s, case["mask"], case["is_causal"])
    expected, expected_weights = reference_attention(case["q"], case["k"], case["v"], allowed, case["bias"],
                                                     case["scale"])
    out, weights = math_attention(
        case["q"], case["k"], case["v"], mask=case["mask"], bias=case["bias"], is_causal=case["is_causal"],
        scale=case["scale"], return_weights=True,
    )
    assert out.shape == (s.b, s.h, s.lq, s.dv)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(weights, expected_weights, **TOL)
    assert_empty_rows_are_zero(out, allowed)


@given(case=attention_cases())
def test_math_weights_are_a_distribution_and_give_the_output(case: dict) -> None:
    s = case["shape"]
    out, weights = math_attention(
        case["q"], case["k"], case["v"], mask=case["mask"], bias=case["bias"], is_causal=case["is_causal"],
        scale=case["scale"], return_weights=True,
    )
    allowed = allowed_keys(s, case["mask"], case["is_causal"])
    assert weights.shape == s.scores
    assert (weights >= 0).all()
    assert torch.equal(weights[~allowed], torch.zeros_like(weights[~allowed]))
    row_sums = weights.sum(dim=-1)
    torch.testing.assert_close(row_sums, allowed.any(dim=-1).float(), **TOL)
    v_full = case["v"].repeat_interleave(s.h // s.hkv, dim=1)  # (B, H, Lk, Dv)
    torch.testing.assert_close(out, weights @ v_full, **TOL)


# ----------------------------------------------------------------------------------------------------------
# Every backend equals math
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_math(name: str) -> None:
    @backend_settings(name)
    @given(case=attention_cases())
    def check(case: dict) -> None:
        kwargs = {key: case[key] for key in ("mask", "bias", "is_causal", "scale")}
        expected = math_attention(case["q"], case["k"], case["v"], **kwargs)
        out = backend(name)(case["q"], case["k"], case["v"], **kwargs)
        s = case["shape"]
        assert out.shape == (s.b, s.h, s.lq, s.dv) and out.dtype == case["q"].dtype
        torch.testing.assert_close(out, expected, **TOL)
        assert_empty_rows_are_zero(out, allowed_keys(s, case["mask"], case["is_causal"]))

    check()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kind", blocks.names("mask"))
def test_backend_matches_math_on_every_registered_mask(name: str, kind: str) -> None:
    @backend_settings(name, max_examples=6)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        s = data.draw(zst.attention_shapes())
        q, k, v = data.draw(zst.qkv(s))
        mask = data.draw(zst.registered_masks(s.b, s.lq, s.lk, kind=kind))
        bias = data.draw(zst.attention_biases(s.b, s.h, s.lq, s.lk))
        out = backend(name)(q, k, v, mask=mask, bias=bias)
        torch.testing.assert_close(out, math_attention(q, k, v, mask=mask, bias=bias), **TOL)
        assert_empty_rows_are_zero(out, allowed_keys(s, mask, False))

    check()


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_returns_zeros_for_fully_masked_rows(name: str) -> None:
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 3) + 1.0
    mask = torch.rand(2, 4, 5, 6) > 0.3
    mask[:, :, 1] = False  # a fully masked query row in every head
    mask[1] = False  # a fully masked batch row
    for bias in (None, torch.randn(2, 4, 5, 6)):
        out = backend(name)(q, k, v, mask=mask, bias=bias)
        assert not out.isnan().any()
        assert torch.equal(out[:, :, 1], torch.zeros(2, 4, 3))
        assert torch.equal(out[1], torch.zeros(4, 5, 3))
        assert out[0, :, 0].abs().sum() > 0  # the other rows are not zeroed
    # Causal with more queries than keys: the first Lq - Lk queries see no key (bottom-right alignment).
    out = backend(name)(torch.randn(1, 2, 7, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4) + 1.0, is_causal=True)
    assert torch.equal(out[:, :, :4], torch.zeros(1, 2, 4, 4))
    assert (out[:, :, 4:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("block_size", [1, 3])
@given(case=attention_cases())
def test_chunked_with_small_blocks_matches_math(block_size: int, case: dict) -> None:
    kwargs = {key: case[key] for key in ("mask", "bias", "is_causal", "scale")}
    expected = math_attention(case["q"], case["k"], case["v"], **kwargs)
    chunked = functools.partial(backend("chunked"), block_size=block_size)
    torch.testing.assert_close(chunked(case["q"], case["k"], case["v"], **kwargs), expected, **TOL)


def test_chunked_rejects_bad_block_size() -> None:
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="block_size"):
        backend("chunked")(q, q, q, block_size=0)


@pytest.mark.parametrize("name", BACKENDS)
def test_low_precision_inputs_with_an_fp32_alibi_bias(name: str) -> None:
    dtype = torch.bfloat16
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 6)
    bias = zst.alibi_bias(2, 4, 5, 7)
    assert bias.dtype == torch.float32
    mask = torch.rand(2, 1, 5, 7) > 0.3
    out = backend(name)(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, bias=bias, is_causal=True)
    assert out.dtype == dtype
    expected = math_attention(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), mask=mask, bias=bias,
                              is_causal=True)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------------------------------------
# Causality
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_causal_outputs_ignore_future_keys(name: str) -> None:
    @backend_settings(name, max_examples=15)
    @given(data=st.data(), lengths=st.sampled_from(["equal", "lq_le_lk"]))
    def check(data: st.DataObject, lengths: str) -> None:
        s = data.draw(zst.attention_shapes(lengths=lengths))
        q, k, v = data.draw(zst.qkv(s))
        cut = data.draw(st.integers(0, s.lk - 1), label="first changed key")
        seed = data.draw(zst.SEEDS)
        k2, v2 = k.clone(), v.clone()
        k2[:, :, cut:] += zst.randn(k2[:, :, cut:].shape, seed)
        v2[:, :, cut:] += 1.0 + zst.randn(v2[:, :, cut:].shape, seed + 1).abs()  # every changed value moves
        out = backend(name)(q, k, v, is_causal=True)
        out2 = backend(name)(q, k2, v2, is_causal=True)
        # Query i sees keys j <= i + Lk - Lq, so queries i < cut - (Lk - Lq) see none of the changed keys.
        unchanged = max(0, cut - (s.lk - s.lq))
        torch.testing.assert_close(out2[:, :, :unchanged], out[:, :, :unchanged], **TOL)
        # And the last query (which sees every key) does change.
        assert not torch.allclose(out2[:, :, -1], out[:, :, -1])

    check()


# ----------------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=10)
@given(data=st.data())
def test_gradients_are_finite_with_fully_masked_rows(name: str, data: st.DataObject) -> None:
    s = data.draw(zst.attention_shapes(max_len=8))
    is_causal = data.draw(st.booleans())
    mask = data.draw(zst.random_bool_masks(s.b, s.h, s.lq, s.lk))
    mask = mask.expand(s.scores).clone()
    mask[..., 0, :] = False  # at least one fully masked query row
    bias_shape = data.draw(st.sampled_from([None, s.scores]))
    seed = data.draw(zst.SEEDS)
    grads = {}
    for which in ("math", name):
        shapes = [(s.b, s.h, s.lq, s.d), (s.b, s.hkv, s.lk, s.d), (s.b, s.hkv, s.lk, s.dv)]
        q, k, v = (zst.randn(shape, seed + i, requires_grad=True) for i, shape in enumerate(shapes))
        leaves = [q, k, v]
        bias = None
        if bias_shape is not None:
            bias = zst.randn(bias_shape, seed + 3, requires_grad=True)
            leaves.append(bias)
        out = call(which, q, k, v, mask=mask, bias=bias, is_causal=is_causal)
        (out * zst.randn(out.shape, seed + 4)).sum().backward()
        for t in leaves:
            assert t.grad is not None and t.grad.isfinite().all(), which
        grads[which] = [t.grad for t in leaves]
        # Fully masked rows give nothing back to their queries.
        assert torch.equal(q.grad[..., 0, :], torch.zeros_like(q.grad[..., 0, :]))
    for g, g_math in zip(grads[name], grads["math"], strict=True):
        torch.testing.assert_close(g, g_math, **TOL)


# ----------------------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------------------


def _supports_dropout(name: str) -> bool:
    q = torch.randn(1, 1, 2, 4)
    try:
        backend(name)(q, q, q, dropout_p=0.5)
    except NotImplementedError:
        return False
    return True


DROPOUT_BACKENDS = [n for n in BACKENDS if _supports_dropout(n)]


def test_the_documented_backends_support_dropout() -> None:
    assert {"math", "sdpa", "chunked"} <= set(DROPOUT_BACKENDS)


@pytest.mark.parametrize("name", DROPOUT_BACKENDS)
def test_tiny_dropout_changes_nothing(name: str) -> None:
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 5)
    mask = torch.rand(2, 1, 6, 7) > 0.4
    for kwargs in ({}, {"mask": mask}, {"is_causal": True}):
        out = backend(name)(q, k, v, dropout_p=1e-9, **kwargs)
        torch.testing.assert_close(out, math_attention(q, k, v, **kwargs), **TOL)


@pytest.mark.parametrize("name", DROPOUT_BACKENDS)
def test_dropout_is_applied_to_the_weights_and_rescaled(name: str) -> None:
    # With v = 1 every output is the (dropped, rescaled) row sum of the weights: 1 in expectation.
    b, h, lq, lk = 4, 4, 64, 16
    q, k = torch.randn(b, h, lq, 8) * 0.1, torch.randn(b, h, lk, 8) * 0.1
    v = torch.ones(b, h, lk, 1)
    mask = torch.ones(b, 1, lq, lk, dtype=torch.bool)
    mask[:, :, :3] = False  # still zeros for fully masked rows under dropout
    for kwargs in ({}, {"mask": mask}):
        torch.manual_seed(1)
        out = backend(name)(q, k, v, dropout_p=0.5, **kwargs)
        assert out.shape == (b, h, lq, 1) and out.isfinite().all()
        assert not torch.allclose(out, math_attention(q, k, v, **kwargs))  # something was dropped
        rows = out[:, :, 3:] if kwargs else out
        assert abs(rows.mean().item() - 1.0) < 0.03
        if kwargs:
            assert torch.equal(out[:, :, :3], torch.zeros(b, h, 3, 1))
        torch.manual_seed(1)
        torch.testing.assert_close(backend(name)(q, k, v, dropout_p=0.5, **kwargs), out)  # seeded = reproducible


@pytest.mark.parametrize("name", sorted(set(BACKENDS) - set(DROPOUT_BACKENDS)))
def test_backends_without_dropout_say_so(name: str) -> None:
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="dropout"):
        backend(name)(q, k, v, dropout_p=0.1)
    torch.testing.assert_close(backend(name)(q, k, v, dropout_p=0.0), math_attention(q, k, v), **TOL)


def test_flex_accepts_aliased_inputs_after_a_masked_call() -> None:
    torch._dynamo.reset()  # the failure needs a fresh recompilation, independent of earlier tests
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    backend("flex")(q, k, v, mask=torch.ones(3, 3, dtype=torch.bool))
    torch.testing.assert_close(backend("flex")(q, q, q), math_attention(q, q, q), **TOL)


def test_flex_has_no_dropout() -> None:
    assert "flex" in BACKENDS and "flex" not in DROPOUT_BACKENDS


# ----------------------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_heads_not_a_multiple_of_kv_heads_raise(name: str) -> None:
    q, k = torch.randn(1, 6, 3, 4), torch.randn(1, 4, 3, 4)
    with pytest.raises(ValueError, match=r"H=6.*Hkv=4"):
        backend(name)(q, k, k)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_non_bool_mask_raises(name: str, dtype: torch.dtype) -> None:
    q = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match=str(dtype)):
        backend(name)(q, q, q, mask=torch.ones(2, 2, 3, 3, dtype=dtype))


def _shape_pattern(which: str, shape: tuple[int, ...]) -> str:
    return rf"{which} of shape {shape}".replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("which", ["mask", "bias"])
@pytest.mark.parametrize(
    "bad",
    [(2, 2, 4, 3, 5), (3, 4, 3, 5), (2, 3, 3, 5), (4, 5), (2, 1, 1, 4)],
    ids=["5-D", "batch", "heads", "queries", "keys"],
)
def test_non_broadcastable_mask_or_bias_raises(name: str, which: str, bad: tuple[int, ...]) -> None:
    q, k, v = torch.randn(2, 4, 3, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)  # scores (2, 4, 3, 5)
    value = torch.ones(bad, dtype=torch.bool) if which == "mask" else torch.zeros(bad)
    pattern = rf"{which} of shape {bad}".replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=pattern):
        backend(name)(q, k, v, **{which: value})


@pytest.mark.parametrize("name", BACKENDS)
def test_other_bad_shapes_raise(name: str) -> None:
    q = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match=r"4-D"):
        backend(name)(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="head dims"):
        backend(name)(q, torch.randn(2, 2, 3, 5), torch.randn(2, 2, 3, 4))
    with pytest.raises(ValueError, match="batch"):
        backend(name)(q, torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4))
    with pytest.raises(ValueError, match="agree"):
        backend(name)(q, torch.randn(2, 2, 3, 4), torch.randn(2, 2, 4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_flex_gradients_equal_math_on_cuda(softcap: float | None) -> None:
    """PyTorch has no flex backward on CPU (the CPU gradient test skips); on CUDA the compiled kernel's gradients
    must equal the reference's, with a mask, a bias, GQA and soft-capping."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 48, 32, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, 64, 32, device="cuda", requires_grad=True)
    v = torch.randn(2, 2, 64, 32, device="cuda", requires_grad=True)
    mask = torch.rand(2, 1, 48, 64, device="cuda") > 0.3
    bias = torch.randn(1, 4, 48, 64, device="cuda")
    grads = []
    for name in ("math", "flex"):
        out = backend(name)(q, k, v, mask=mask, bias=bias, is_causal=True, softcap=softcap)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for ref, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", BACKENDS)
@given(data=st.data())
@settings(max_examples=5)
def test_softcap_equals_the_formula(name: str, data: st.DataObject) -> None:
    """Gemma 2's capping: softmax(cap · tanh(q·k·scale / cap) + bias) V, written out in float64."""
    case = data.draw(attention_cases())
    q, k, v, mask = case["q"], case["k"], case["v"], case["mask"]
    cap = data.draw(st.sampled_from([0.5, 2.0, 30.0]))
    h, hkv = q.shape[1], k.shape[1]
    kv_head = torch.arange(h) // (h // hkv)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()[:, kv_head]) / math.sqrt(q.shape[-1])
    scores = cap * torch.tanh(scores / cap)
    allowed = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.expand_as(scores)
    weights = torch.nan_to_num(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1), nan=0.0)
    expected = (weights @ v.double()[:, kv_head]).float()
    with torch.no_grad():
        torch.testing.assert_close(call(name, q, k, v, mask=mask, softcap=cap), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", BACKENDS)
def test_zero_keys_give_zero_rows_and_mixed_dtypes_are_refused(name: str) -> None:
    q = torch.randn(1, 2, 3, 4)
    empty = torch.randn(1, 2, 0, 4)
    assert torch.equal(backend(name)(q, empty, empty), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="one dtype"):
        backend(name)(q, q.double(), q)
