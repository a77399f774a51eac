"""MultiHeadAttention (self/cross, GQA, backends, weights) and the KV caches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import blocks
from blocks import KVCache, LayerCache, MultiHeadAttention, StaticKVCache, reorder_caches
from tests import strategies as zst

BACKENDS = blocks.names("attention_backend")
TOL = {"atol": 1e-5, "rtol": 1e-5}


def mha(**cfg) -> MultiHeadAttention:  # noqa: ANN003
    return blocks.build("attention", "mha", **cfg).eval().requires_grad_(False)


def rope(d_head: int) -> blocks.positional.PositionalEncoding:
    return blocks.build("positional", "rotary", d_model=d_head, n_heads=1)


def manual_mha(
    m: MultiHeadAttention, x: Tensor, context: Tensor, mask: Tensor | None = None, is_causal: bool = False
) -> Tensor:
    """The paper's MultiHead(Q, K, V) written out head by head (query head h uses key/value head h // group)."""
    b, lq, _ = x.shape
    lk = context.shape[1]
    q = m.q_proj(x).view(b, lq, m.n_heads, m.d_head)
    k = m.k_proj(context).view(b, lk, m.n_kv_heads, m.d_head)
    v = m.v_proj(context).view(b, lk, m.n_kv_heads, m.d_value)
    group = m.n_heads // m.n_kv_heads
    allowed = torch.ones(b, m.n_heads, lq, lk, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if is_causal:
        allowed = allowed & (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq)
    heads = []
    for h in range(m.n_heads):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(-2, -1) / math.sqrt(m.d_head)  # (B, Lq, Lk)
        weights = torch.softmax(scores.masked_fill(~allowed[:, h], float("-inf")), dim=-1).nan_to_num(0.0)
        heads.append(weights @ v[:, :, h // group])  # (B, Lq, Dv)
    return m.o_proj(torch.cat(heads, dim=-1))


@st.composite
def mha_configs(draw: st.DrawFn) -> dict:
    dims = draw(zst.model_dims())
    if draw(st.booleans()):  # d_head / d_value independent of d_model (paper Table 3 rows A, B)
        dims["d_head"] = draw(st.integers(1, 4)) * 2
        dims["d_value"] = draw(st.integers(1, 6))
    dims["bias"] = draw(st.booleans())
    return dims


# ----------------------------------------------------------------------------------------------------------
# Shapes, formula, weights
# ----------------------------------------------------------------------------------------------------------


@given(cfg=mha_configs(), b=st.integers(1, 3), lq=st.integers(1, 10), seed=zst.SEEDS)
def test_self_attention_matches_the_paper_formula(cfg: dict, b: int, lq: int, seed: int) -> None:
    m = mha(**cfg)
    x = zst.randn((b, lq, cfg["d_model"]), seed)
    out, weights = m(x)
    assert out.shape == (b, lq, cfg["d_model"]) and weights is None
    torch.testing.assert_close(out, manual_mha(m, x, x), **TOL)
    out_causal, _ = m(x, is_causal=True)
    torch.testing.assert_close(out_causal, manual_mha(m, x, x, is_causal=True), **TOL)


@given(data=st.data(), cfg=mha_configs(), b=st.integers(1, 3), lq=st.integers(1, 8), lk=st.integers(1, 10))
def test_cross_attention_with_a_different_context_length_and_width(
    data: st.DataObject, cfg: dict, b: int, lq: int, lk: int
) -> None:
    d_context = data.draw(st.integers(1, 12))
    m = mha(**cfg, d_context=d_context)
    seed = data.draw(zst.SEEDS)
    x, context = zst.randn((b, lq, cfg["d_model"]), seed), zst.randn((b, lk, d_context), seed + 1)
    keep = data.draw(zst.padding_masks(b, lk))
    mask = blocks.padding_mask(keep)
    out, weights = m(x, context, mask=mask, need_weights=True)
    assert out.shape == (b, lq, cfg["d_model"])
    assert weights.shape == (b, cfg["n_heads"], lq, lk)
    torch.testing.assert_close(out, manual_mha(m, x, context, mask=mask), **TOL)
    assert torch.equal(weights * ~mask, torch.zeros_like(weights))  # padded keys get no weight


@given(cfg=mha_configs(), b=st.integers(1, 3), lq=st.integers(1, 10), seed=zst.SEEDS, causal=st.booleans())
def test_need_weights_returns_the_attention_distribution(cfg: dict, b: int, lq: int, seed: int, causal: bool) -> None:
    m = mha(**cfg)
    x = zst.randn((b, lq, cfg["d_model"]), seed)
    out, weights = m(x, is_causal=causal, need_weights=True)
    assert weights.shape == (b, cfg["n_heads"], lq, lq)
    torch.testing.assert_close(weights.sum(-1), torch.ones(b, cfg["n_heads"], lq), **TOL)
    if causal:
        assert torch.equal(weights.triu(1), torch.zeros_like(weights))
    # Asking for the weights does not change the output.
    torch.testing.assert_close(out, m(x, is_causal=causal)[0], **TOL)


@settings(max_examples=10)
@given(cfg=mha_configs(), b=st.integers(1, 2), length=st.integers(1, 8), shift=st.integers(1, 50), seed=zst.SEEDS,
       causal=st.booleans())
def test_rotary_attention_rotates_queries_and_keys(
    cfg: dict, b: int, length: int, shift: int, seed: int, causal: bool
) -> None:
    m = mha(**cfg)
    pe = rope(cfg["d_head"])
    x = zst.randn((b, length, cfg["d_model"]), seed)
    positions = torch.arange(length).expand(b, length)
    out = m(x, is_causal=causal, rotary=pe, positions=positions)[0]
    # Both q and k are rotated, so only relative positions matter: shifting every position changes nothing.
    torch.testing.assert_close(m(x, is_causal=causal, rotary=pe, positions=positions + shift)[0], out, **TOL)
    # Written out: rotate the projected q and k by their positions, then attend.
    q = pe.rotate(m.q_proj(x).view(b, length, m.n_heads, m.d_head).transpose(1, 2), positions)
    k = pe.rotate(m.k_proj(x).view(b, length, m.n_kv_heads, m.d_head).transpose(1, 2), positions)
    v = m.v_proj(x).view(b, length, m.n_kv_heads, m.d_value).transpose(1, 2)
    heads = blocks.get("attention_backend", "math")(q, k, v, is_causal=causal)
    expected = m.o_proj(heads.transpose(1, 2).reshape(b, length, m.n_heads * m.d_value))
    torch.testing.assert_close(out, expected, **TOL)


def test_padded_query_rows_with_no_keys_give_zeros_before_the_output_projection() -> None:
    m = mha(d_model=8, n_heads=2, bias=False)
    x = torch.randn(2, 3, 8)
    keep = torch.tensor([[True, True, False], [False, False, False]])  # the second row has no real key
    out, _ = m(x, mask=blocks.padding_mask(keep))
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros(3, 8))  # zeros through a bias-free o_proj


# ----------------------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_set_backend_switches_and_results_agree(name: str) -> None:
    m = mha(d_model=12, n_heads=6, n_kv_heads=2, d_value=3)
    assert m.backend == "sdpa"
    x, memory = torch.randn(2, 7, 12), torch.randn(2, 5, 12)
    keep = torch.tensor([[True] * 5, [True, True, False, False, True]])
    mask, bias = torch.rand(2, 1, 7, 7) > 0.3, torch.randn(1, 6, 7, 7)
    calls = [
        lambda: m(x, mask=mask, is_causal=True, bias=bias)[0],
        lambda: m(x, memory, mask=blocks.padding_mask(keep))[0],
        lambda: m(x[:, :3], memory, is_causal=True)[0],
    ]
    m.set_backend("math")
    expected = [c() for c in calls]
    m.set_backend(name)
    assert m.backend == name and name in repr(m)
    assert m._backend is blocks.get("attention_backend", name)
    for c, e in zip(calls, expected, strict=True):
        torch.testing.assert_close(c(), e, **TOL)


def test_set_backend_rejects_unknown_names() -> None:
    m = mha(d_model=8, n_heads=2)
    with pytest.raises(ValueError, match="no_such_backend"):
        m.set_backend("no_such_backend")
    with pytest.raises(ValueError, match="no_such_backend"):
        mha(d_model=8, n_heads=2, backend="no_such_backend")


@pytest.mark.parametrize("name", BACKENDS)
def test_causal_self_attention_ignores_future_inputs(name: str) -> None:
    # Eager flex on CPU re-traces for every new shape pattern: fewer examples there.
    @settings(max_examples=2 if name == "flex" else 6)
    @given(cfg=mha_configs(), b=st.integers(1, 2), length=st.integers(2, 10), data=st.data())
    def check(cfg: dict, b: int, length: int, data: st.DataObject) -> None:
        m = mha(**cfg, backend=name)
        seed = data.draw(zst.SEEDS)
        cut = data.draw(st.integers(1, length - 1))
        x = zst.randn((b, length, cfg["d_model"]), seed)
        x2 = x.clone()
        x2[:, cut:] = zst.randn(x2[:, cut:].shape, seed + 1)
        pe = rope(cfg["d_head"])
        positions = torch.arange(length)[None]
        out = m(x, is_causal=True, rotary=pe, positions=positions)[0]
        out2 = m(x2, is_causal=True, rotary=pe, positions=positions)[0]
        torch.testing.assert_close(out2[:, :cut], out[:, :cut], **TOL)
        assert not torch.allclose(out2[:, -1], out[:, -1])

    check()


def test_attention_dropout_only_in_training() -> None:
    m = mha(d_model=8, n_heads=2, dropout=0.5, backend="math")
    x = torch.randn(2, 6, 8)
    eval_out = m(x)[0]
    torch.testing.assert_close(m(x)[0], eval_out)  # deterministic in eval
    m.train()
    assert not torch.allclose(m(x)[0], eval_out)


# ----------------------------------------------------------------------------------------------------------
# KV caches
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
def test_token_by_token_with_kv_cache_equals_the_full_causal_forward(name: str) -> None:
    m = mha(d_model=12, n_heads=4, n_kv_heads=2, d_head=4, d_value=5, backend=name)
    pe = rope(4)
    b, length = 2, 6
    x = torch.randn(b, length, 12)
    positions = torch.arange(length).expand(b, length)
    full = m(x, is_causal=True, rotary=pe, positions=positions)[0]
    cache = KVCache(max_len=length)
    steps = [m(x[:, t : t + 1], is_causal=True, rotary=pe, positions=positions[:, t : t + 1], cache=cache)[0]
             for t in range(length)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
    assert cache.length == length


@settings(max_examples=10)
@given(cfg=mha_configs(), b=st.integers(1, 2), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       seed=zst.SEEDS)
def test_chunked_prefill_with_kv_cache_equals_the_full_causal_forward(
    cfg: dict, b: int, chunks: list[int], seed: int
) -> None:
    m = mha(**cfg)
    pe = rope(cfg["d_head"])
    length = sum(chunks)
    x = zst.randn((b, length, cfg["d_model"]), seed)
    positions = torch.arange(length).expand(b, length)
    full = m(x, is_causal=True, rotary=pe, positions=positions)[0]
    cache = KVCache(max_len=length + 3)
    outs, start = [], 0
    for n in chunks:  # a prompt in pieces: each block of queries follows the cached keys (bottom-right causal)
        sl = slice(start, start + n)
        outs.append(m(x[:, sl], is_causal=True, rotary=pe, positions=positions[:, sl], cache=cache)[0])
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL)


def test_kv_cache_update_and_errors() -> None:
    with pytest.raises(ValueError, match="0"):
        KVCache(max_len=0)
    cache = KVCache(max_len=4)
    k1, v1 = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 5)
    k, v = cache.update(k1, v1)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 5)
    k, v = cache.update(k2, v2)
    assert torch.equal(k, torch.cat([k1, k2], dim=2)) and torch.equal(v, torch.cat([v1, v2], dim=2))
    with pytest.raises(ValueError, match=r"4 cached \+ 1 new.*max_len=4"):
        cache.update(k2, v2)


def test_kv_cache_reorder_selects_batch_rows() -> None:
    caches = [LayerCache(max_len=5, cross=True), LayerCache(max_len=5)]
    k, v = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    for c in caches:
        c.self_attn.update(k, v)
    caches[0].cross_attn.set(k + 1, v + 1)
    index = torch.tensor([2, 2, 0])
    reorder_caches(caches, index)
    for c in caches:
        assert torch.equal(c.self_attn.k[:, :, :2], k[index]) and torch.equal(c.self_attn.v[:, :, :2], v[index])
    assert torch.equal(caches[0].cross_attn.k, (k + 1)[index])
    assert torch.equal(caches[0].cross_attn.v, (v + 1)[index])


def test_static_kv_cache_reuses_the_cross_attention_keys() -> None:
    m = mha(d_model=8, n_heads=4, n_kv_heads=2, d_context=6)
    x, memory = torch.randn(2, 5, 8), torch.randn(2, 7, 6)
    mask = blocks.padding_mask(torch.tensor([[True] * 7, [True] * 4 + [False] * 3]))
    full = m(x, memory, mask=mask)[0]
    projections = []
    m.k_proj.register_forward_hook(lambda mod, inp, out: projections.append("k"))
    m.v_proj.register_forward_hook(lambda mod, inp, out: projections.append("v"))
    cache = StaticKVCache()
    assert not cache.filled
    steps = [m(x[:, :1], memory, mask=mask, cache=cache)[0]]
    assert cache.filled and cache.k.shape == (2, 2, 7, 2)
    assert projections == ["k", "v"]
    cached_k = cache.k
    # Later steps reuse the cached keys/values: no projection of the memory, even without it.
    steps += [m(x[:, t : t + 1], None, mask=mask, cache=cache)[0] for t in range(1, 5)]
    assert projections == ["k", "v"]
    assert cache.k is cached_k
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


@pytest.mark.parametrize("grad", [True, False])
def test_outputs_follow_parameter_updates(grad: bool) -> None:
    m = mha(d_model=8, n_heads=2, n_kv_heads=1, d_value=3)
    x = torch.randn(2, 4, 8)
    with torch.set_grad_enabled(grad):
        before = m(x)[0]
        torch.testing.assert_close(m(x)[0], before)
        with torch.no_grad():
            m.k_proj.weight.mul_(2)  # an optimizer-style in-place step
        after = m(x)[0]
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, manual_mha(m, x, x), **TOL)
        m.load_state_dict({name: p * 0.5 for name, p in m.state_dict().items()})
        torch.testing.assert_close(m(x)[0], manual_mha(m, x, x), **TOL)


def test_outputs_follow_in_place_edits_through_param_data() -> None:
    m = mha(d_model=8, n_heads=2)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        m(x)
        m.q_proj.weight.data.mul_(2)
        torch.testing.assert_close(m(x)[0], manual_mha(m, x, x), **TOL)


# ----------------------------------------------------------------------------------------------------------
# Configuration errors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"d_model": 10, "n_heads": 4}, r"d_model=10.*n_heads=4"),
        ({"d_model": 8, "n_heads": 4, "n_kv_heads": 3}, r"n_heads=4.*n_kv_heads=3"),
        ({"d_model": 8, "n_heads": 6, "n_kv_heads": 4, "d_head": 2}, r"n_heads=6.*n_kv_heads=4"),
        ({"d_model": 0, "n_heads": 1}, "0"),
        ({"d_model": 8, "n_heads": 0}, "0"),
        ({"d_model": 8, "n_heads": 2, "dropout": 1.0}, r"dropout.*1\.0"),
        ({"d_model": 8, "n_heads": 2, "dropout": -0.1}, r"-0\.1"),
        ({"d_model": 8, "n_heads": 2, "d_value": 0}, "0"),
        ({"d_model": 8, "n_heads": 2, "heads": 2}, "heads"),
    ],
)
def test_bad_config_raises_value_error(cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        blocks.build("attention", "mha", **cfg)


def test_d_head_given_explicitly_allows_any_d_model() -> None:
    m = mha(d_model=10, n_heads=4, d_head=3)
    assert m.q_proj.weight.shape == (12, 10) and m.o_proj.weight.shape == (10, 12)
    assert m(torch.randn(1, 2, 10))[0].shape == (1, 2, 10)


def test_projection_names_and_shapes_follow_checkpoint_conventions() -> None:
    m = mha(d_model=12, n_heads=4, n_kv_heads=2, d_value=5)
    shapes = {name: tuple(p.shape) for name, p in m.named_parameters()}
    assert shapes == {
        "q_proj.weight": (12, 12), "q_proj.bias": (12,),
        "k_proj.weight": (6, 12), "k_proj.bias": (6,),
        "v_proj.weight": (10, 12), "v_proj.bias": (10,),
        "o_proj.weight": (12, 20), "o_proj.bias": (12,),
    }


def test_rotary_without_positions_raises() -> None:
    m = mha(d_model=8, n_heads=2)
    with pytest.raises(ValueError, match="positions"):
        m(torch.randn(1, 3, 8), rotary=rope(4))
