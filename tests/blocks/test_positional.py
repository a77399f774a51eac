"""Positional encodings against the papers' formulas, computed by hand with ``math``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import blocks
from blocks.positional import PositionalEncoding, alibi_slopes, sinusoid_table
from tests import strategies as zst

TOL = {"atol": 1e-5, "rtol": 1e-5}
even_dims = st.integers(1, 8).map(lambda n: 2 * n)


def paper_sinusoid(pos: int, dim: int, d_model: int, layout: str) -> float:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    if layout == "interleave":
        i, use_cos = dim // 2, dim % 2 == 1
    else:  # concat: [sin(pos / 10000^(2i/d)) for i < d/2 | cos(... same i)]
        i, use_cos = dim % (d_model // 2), dim >= d_model // 2
    angle = pos / 10000 ** (2 * i / d_model)
    return math.cos(angle) if use_cos else math.sin(angle)


def paper_table(n: int, d_model: int, layout: str) -> torch.Tensor:
    return torch.tensor([[paper_sinusoid(p, j, d_model, layout) for j in range(d_model)] for p in range(n)])


# ----------------------------------------------------------------------------------------------------------
# Every registered positional encoding
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", blocks.names("positional"))
def test_every_positional_encoding_builds_from_the_model_shape_and_keeps_shapes(name: str) -> None:
    pe = blocks.build("positional", name, d_model=8, n_heads=2, d_head=4, max_len=16)
    assert isinstance(pe, PositionalEncoding)
    x = torch.randn(2, 5, 8)
    positions = torch.arange(5).expand(2, 5)
    assert pe(x, positions).shape == x.shape
    qk = torch.randn(2, 2, 5, 4)
    assert pe.rotate(qk, positions).shape == qk.shape
    assert pe.rotates == name.startswith("rotary")
    bias = pe.attention_bias(positions, positions)
    assert bias is None or torch.broadcast_shapes(bias.shape, (2, 2, 5, 5)) == (2, 2, 5, 5)
    # Derived tables are not checkpointed: only learned weights appear in the state dict.
    assert set(pe.state_dict()) == {name for name, _ in pe.named_parameters()}


def test_none_is_the_identity_everywhere() -> None:
    pe = blocks.build("positional", "none", d_model=6)
    x = torch.randn(2, 4, 6)
    positions = torch.arange(4)[None]
    assert torch.equal(pe(x, positions), x)
    qk = torch.randn(2, 3, 4, 2)
    assert torch.equal(pe.rotate(qk, positions), qk)
    assert pe.attention_bias(positions, positions) is None


# ----------------------------------------------------------------------------------------------------------
# Sinusoidal
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "layout"), [("sinusoidal", "interleave"), ("sinusoidal_concat", "concat")])
@given(d_model=even_dims, n=st.integers(1, 24))
def test_sinusoidal_matches_the_paper_formula(name: str, layout: str, d_model: int, n: int) -> None:
    pe = blocks.build("positional", name, d_model=d_model, max_len=32)
    expected = paper_table(n, d_model, layout)
    x = torch.zeros(1, n, d_model)
    torch.testing.assert_close(pe(x, torch.arange(n)[None]), expected[None], **TOL)
    torch.testing.assert_close(sinusoid_table(n, d_model, layout), expected, **TOL)


def test_sinusoidal_layouts_by_example() -> None:
    d, pos = 4, 3
    w1 = pos / 10000 ** (2 / 4)
    interleave = [math.sin(pos), math.cos(pos), math.sin(w1), math.cos(w1)]
    concat = [math.sin(pos), math.sin(w1), math.cos(pos), math.cos(w1)]
    torch.testing.assert_close(sinusoid_table(4, d, "interleave")[pos], torch.tensor(interleave), **TOL)
    torch.testing.assert_close(sinusoid_table(4, d, "concat")[pos], torch.tensor(concat), **TOL)


@pytest.mark.parametrize(("name", "layout"), [("sinusoidal", "interleave"), ("sinusoidal_concat", "concat")])
def test_sinusoidal_adds_to_the_embeddings_with_batched_positions(name: str, layout: str) -> None:
    pe = blocks.build("positional", name, d_model=6, max_len=16)
    x = torch.randn(2, 3, 6)
    positions = torch.tensor([[0, 1, 2], [5, 9, 7]])
    expected = x + paper_table(10, 6, layout)[positions]
    torch.testing.assert_close(pe(x, positions), expected, **TOL)


@pytest.mark.parametrize(("name", "layout"), [("sinusoidal", "interleave"), ("sinusoidal_concat", "concat")])
def test_sinusoidal_table_extends_beyond_max_len_and_is_not_persistent(name: str, layout: str) -> None:
    pe = blocks.build("positional", name, d_model=6, max_len=4)
    assert "table" not in pe.state_dict()
    positions = torch.arange(40)[None]
    out = pe(torch.zeros(1, 40, 6), positions)
    torch.testing.assert_close(out[0], paper_table(40, 6, layout), **TOL)
    assert "table" not in pe.state_dict()  # still non-persistent after growing
    assert dict(pe.named_buffers())["table"].shape[0] >= 40
    assert pe.state_dict() == {}


def test_sinusoidal_bad_arguments() -> None:
    with pytest.raises(ValueError, match="5"):
        blocks.build("positional", "sinusoidal", d_model=5)
    with pytest.raises(ValueError, match="diagonal"):
        blocks.build("positional", "sinusoidal", d_model=4, layout="diagonal")


# ----------------------------------------------------------------------------------------------------------
# Learned
# ----------------------------------------------------------------------------------------------------------


def test_learned_adds_its_weight_rows() -> None:
    pe = blocks.build("positional", "learned", d_model=4, max_len=6)
    assert set(pe.state_dict()) == {"weight"} and pe.weight.shape == (6, 4)
    x = torch.randn(2, 3, 4)
    positions = torch.tensor([[0, 1, 2], [3, 5, 4]])
    torch.testing.assert_close(pe(x, positions), x + pe.weight[positions], **TOL)


@pytest.mark.parametrize("too_far", [6, 7, 100])
def test_learned_raises_past_max_len(too_far: int) -> None:
    pe = blocks.build("positional", "learned", d_model=4, max_len=6)
    pe(torch.zeros(1, 1, 4), torch.tensor([[5]]))  # the last valid position
    with pytest.raises(ValueError, match=rf"position {too_far}.*max_len=6"):
        pe(torch.zeros(1, 2, 4), torch.tensor([[0, too_far]]))


# ----------------------------------------------------------------------------------------------------------
# Rotary
# ----------------------------------------------------------------------------------------------------------


def rotary(d_head: int, n_heads: int = 1) -> PositionalEncoding:
    return blocks.build("positional", "rotary", d_model=d_head * n_heads, n_heads=n_heads)


@given(d_head=even_dims, pos=st.integers(0, 50), seed=zst.SEEDS)
def test_rotary_matches_the_rotate_half_formula(d_head: int, pos: int, seed: int) -> None:
    x = zst.randn((1, 1, 1, d_head), seed)
    out = rotary(d_head).rotate(x, torch.tensor([[pos]]))[0, 0, 0]
    half = d_head // 2
    xs = x[0, 0, 0].tolist()
    expected = [0.0] * d_head
    for i in range(half):
        theta = pos / 10000 ** (2 * i / d_head)
        a, b = xs[i], xs[i + half]
        expected[i] = a * math.cos(theta) - b * math.sin(theta)
        expected[i + half] = b * math.cos(theta) + a * math.sin(theta)
    torch.testing.assert_close(out, torch.tensor(expected), **TOL)


@given(d_head=even_dims, length=st.integers(1, 12), seed=zst.SEEDS, start=st.integers(0, 100))
def test_rotary_keeps_vector_norms(d_head: int, length: int, seed: int, start: int) -> None:
    x = zst.randn((2, 3, length, d_head), seed)
    positions = torch.arange(start, start + length).expand(2, length)
    out = rotary(d_head, 3).rotate(x, positions)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), **TOL)


@given(d_head=even_dims, m=st.integers(0, 40), n=st.integers(0, 40), t=st.integers(1, 40), seed=zst.SEEDS)
def test_rotary_dot_product_depends_only_on_the_offset(d_head: int, m: int, n: int, t: int, seed: int) -> None:
    pe = rotary(d_head)
    q, k = zst.randn((1, 1, 1, d_head), seed), zst.randn((1, 1, 1, d_head), seed + 1)

    def score(pq: int, pk: int) -> torch.Tensor:
        return (pe.rotate(q, torch.tensor([[pq]])) * pe.rotate(k, torch.tensor([[pk]]))).sum()

    torch.testing.assert_close(score(m + t, n + t), score(m, n), **TOL)


def test_rotary_position_zero_is_the_identity_and_other_positions_are_not() -> None:
    pe = rotary(8, 2)
    x = torch.randn(2, 2, 3, 8)
    assert torch.equal(pe.rotate(x, torch.zeros(2, 3, dtype=torch.long)), x)
    assert not torch.allclose(pe.rotate(x, torch.ones(2, 3, dtype=torch.long)), x)
    # Each batch row uses its own positions.
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]])
    out = pe.rotate(x, positions)
    for row in range(2):
        torch.testing.assert_close(out[row : row + 1], pe.rotate(x[row : row + 1], positions[row : row + 1]), **TOL)


def test_rotary_needs_an_even_head_dim() -> None:
    with pytest.raises(ValueError, match="5"):
        blocks.build("positional", "rotary", d_model=10, n_heads=2)


# ----------------------------------------------------------------------------------------------------------
# ALiBi
# ----------------------------------------------------------------------------------------------------------


def test_alibi_slopes_for_eight_heads() -> None:
    expected = [1 / 2**i for i in range(1, 9)]  # 1/2, 1/4, ..., 1/256
    torch.testing.assert_close(alibi_slopes(8), torch.tensor(expected), **TOL)


@pytest.mark.parametrize("n", [1, 2, 4, 16, 32])
def test_alibi_slopes_for_powers_of_two_are_geometric_from_2_to_the_minus_8_over_n(n: int) -> None:
    ratio = 2 ** (-8 / n)
    torch.testing.assert_close(alibi_slopes(n), torch.tensor([ratio ** (i + 1) for i in range(n)]), **TOL)


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12, 20, 24])
def test_alibi_slopes_for_other_head_counts_interleave_the_next_power_of_two(n: int) -> None:
    lower = 2 ** math.floor(math.log2(n))
    base = [2 ** (-8 * (i + 1) / lower) for i in range(lower)]
    upper = [2 ** (-8 * (i + 1) / (2 * lower)) for i in range(2 * lower)]
    expected = base + upper[0::2][: n - lower]
    torch.testing.assert_close(alibi_slopes(n), torch.tensor(expected), **TOL)


def test_alibi_slopes_for_twelve_heads_by_example() -> None:
    # The 8-head slopes, then every other slope of the 16-head sequence 2^-0.5, 2^-1, 2^-1.5, ...
    expected = [1 / 2**i for i in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected), **TOL)


def test_alibi_slopes_reject_zero_heads() -> None:
    with pytest.raises(ValueError, match="0"):
        alibi_slopes(0)


@given(n_heads=st.integers(1, 12), lq=st.integers(1, 8), lk=st.integers(1, 8), b=st.integers(1, 2))
def test_alibi_bias_is_minus_slope_times_distance(n_heads: int, lq: int, lk: int, b: int) -> None:
    pe = blocks.build("positional", "alibi", d_model=4 * n_heads, n_heads=n_heads)
    q_pos = (torch.arange(lq) + torch.arange(b)[:, None] * 3).expand(b, lq)
    k_pos = torch.arange(lk).expand(b, lk)
    bias = pe.attention_bias(q_pos, k_pos)
    assert bias.shape == (b, n_heads, lq, lk)
    slopes = alibi_slopes(n_heads).tolist()
    for r in range(b):
        for h in range(n_heads):
            expected = [[-slopes[h] * abs(int(q_pos[r, i]) - int(k_pos[r, j])) for j in range(lk)] for i in range(lq)]
            torch.testing.assert_close(bias[r, h], torch.tensor(expected), **TOL)
    assert "slopes" not in pe.state_dict()


# ----------------------------------------------------------------------------------------------------------
# Half precision: tables and frequencies stay float32 whatever the module dtype
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", blocks.names("positional"))
def test_positional_math_stays_float32_in_half_precision(name: str, dtype: torch.dtype) -> None:
    """``.to(half)`` must not round the rotary frequencies or the sinusoid table: at position 3000 the angles
    would be off by ~0.5 rad. Each kind's output in half precision equals its float32 output rounded once."""
    exact = blocks.build("positional", name, d_model=64, n_heads=2, d_head=32, max_len=4096)
    half = blocks.build("positional", name, d_model=64, n_heads=2, d_head=32, max_len=4096)
    half.load_state_dict(exact.state_dict())
    half.to(dtype)
    for buffer_name, buffer in half.named_buffers():
        assert buffer.dtype == torch.float32, f"{name}.{buffer_name} became {buffer.dtype}"
    positions = torch.tensor([[0, 1, 2999, 3000, 4095]])
    x = torch.randn(1, 5, 64)
    qk = torch.randn(1, 2, 5, 32)
    tol = dict(atol=0.05, rtol=0.02)  # one rounding of values of magnitude <= ~4 in bf16
    torch.testing.assert_close(half(x.to(dtype), positions).float(), exact(x, positions), **tol)
    torch.testing.assert_close(half.rotate(qk.to(dtype), positions).float(), exact.rotate(qk, positions), **tol)
    bias = exact.attention_bias(positions, positions)
    if bias is not None:
        torch.testing.assert_close(half.attention_bias(positions, positions).float(), bias, **tol)


def test_rotary_frequencies_follow_the_formulas() -> None:
    """``θ^(-2i/d)``; linear scaling divides every frequency; llama3 keeps high, divides low, blends the band."""
    from blocks.positional import rotary_frequencies

    base = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(rotary_frequencies(16, 10000.0).double(), base)
    torch.testing.assert_close(rotary_frequencies(16, 10000.0, {"type": "linear", "factor": 4.0}).double(), base / 4)
    scaled = rotary_frequencies(16, 10000.0, {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_len": 64}).double()
    wavelength = 2 * torch.pi / base
    high, low = wavelength < 64 / 4, wavelength > 64 / 1
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8)
    band = ~(high | low)
    smooth = (64 / wavelength[band] - 1.0) / (4.0 - 1.0)
    torch.testing.assert_close(scaled[band], (1 - smooth) * base[band] / 8 + smooth * base[band], rtol=1e-5, atol=0)
    assert high.any() and low.any() and band.any()
    with pytest.raises(ValueError, match="yarn"):
        rotary_frequencies(16, 10000.0, {"type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("name", ["rotary", "rotary_interleaved"])
def test_rotary_preserves_norms_and_depends_on_offsets_only(name: str) -> None:
    pe = blocks.build("positional", name, d_model=16, n_heads=1, fraction=0.5)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    dots = [
        (pe.rotate(q, torch.tensor([[i + 7]])) * pe.rotate(k, torch.tensor([[i]]))).sum() for i in (0, 5, 40)
    ]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(3), atol=1e-4, rtol=0)
    rotated = pe.rotate(q, torch.tensor([[9]]))
    torch.testing.assert_close(rotated.norm(), q.norm())
    assert torch.equal(rotated[..., 8:], q[..., 8:])  # fraction 0.5: the second half passes through


def test_interleaved_rotary_is_rotate_half_on_permuted_dimensions() -> None:
    """GPT-J's pairs (2i, 2i+1) are rotate-half's pairs (i, i + d/2) after de-interleaving the dimensions."""
    half = blocks.build("positional", "rotary", d_model=8, n_heads=1)
    pairs = blocks.build("positional", "rotary_interleaved", d_model=8, n_heads=1)
    x = torch.randn(2, 1, 5, 8)
    positions = torch.arange(3, 8)[None].expand(2, 5)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved -> [evens | odds]
    torch.testing.assert_close(pairs.rotate(x, positions)[..., perm], half.rotate(x[..., perm], positions))


def test_t5_buckets_match_the_published_scheme() -> None:
    """Raffel et al.: exact buckets below num_buckets/4 (bidirectional), log-spaced to max_distance, then capped."""
    from blocks.positional import relative_position_buckets

    rel = torch.tensor([-200, -128, -20, -8, -7, -1, 0, 1, 7, 8, 20, 200])
    bidirectional = relative_position_buckets(rel, causal=False, num_buckets=32, max_distance=128)
    # keys before the query: buckets 0..15 by distance; after: 16 + the same
    assert bidirectional.tolist()[5:9] == [1, 0, 17, 23]
    assert bidirectional[0] == 15 and bidirectional[-1] == 31  # capped beyond max_distance
    exact = 8
    import math
    expected_20 = exact + int(math.log(20 / exact) / math.log(128 / exact) * (16 - exact))
    assert bidirectional[2] == expected_20 and bidirectional[-2] == 16 + expected_20
    causal = relative_position_buckets(rel, causal=True, num_buckets=32, max_distance=128)
    assert causal[rel >= 0].tolist() == [0] * 6  # later keys (masked anyway) share bucket 0
    assert causal.tolist()[:6] == [31, 31, 16 + int(math.log(20 / 16) / math.log(128 / 16) * 16), 8, 7, 1]


YARN = [
    {"factor": 4.0, "original_max_position_embeddings": 1024},
    {"factor": 16.0, "original_max_position_embeddings": 4096, "beta_fast": 24.0, "beta_slow": 2.0,
     "mscale": 0.707, "mscale_all_dim": 0.5, "truncate": False},
    {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 1.3},
]


@pytest.mark.parametrize("parameters", YARN, ids=["plain", "mscale-beta-no-truncate", "attention-factor"])
@pytest.mark.parametrize("dim", [16, 64])
def test_yarn_frequencies_and_attention_factor_equal_transformers(parameters: dict, dim: int) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from blocks.positional.rotary import rotary_scaling

    hf = transformers.LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, max_position_embeddings=8192,
                                  rope_scaling={"rope_type": "yarn", "rope_theta": 50000.0, **parameters})
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = {k: v for k, v in parameters.items() if k != "original_max_position_embeddings"}
    got = rotary_scaling(dim, 50000.0, {"type": "yarn", "original_max_len": parameters[
        "original_max_position_embeddings"], **ours})
    torch.testing.assert_close(got.inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert got.attention_factor == pytest.approx(attention, rel=1e-12)
    assert not torch.equal(got.inv_freq, rotary_scaling(dim, 50000.0).inv_freq)  # scaling did something


def test_longrope_sets_and_switch_equal_transformers() -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from blocks.positional import RotaryPositionalEncoding

    short, long = [1.0, 1.2, 1.9, 2.5], [1.5, 3.0, 7.0, 16.0]
    hf = transformers.Phi3Config(hidden_size=32, num_attention_heads=4, max_position_embeddings=256,
                                 original_max_position_embeddings=32,
                                 rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                               "original_max_position_embeddings": 32})
    short_hf, attention = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    long_hf, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=33)
    rotary = RotaryPositionalEncoding(32, 4, max_len=256, scaling={
        "type": "longrope", "short_factor": short, "long_factor": long, "original_max_len": 32})
    torch.testing.assert_close(rotary.inv_freq, short_hf, rtol=1e-6, atol=0)
    torch.testing.assert_close(rotary.long_inv_freq, long_hf, rtol=1e-6, atol=0)
    assert rotary.attention_factor == pytest.approx(attention)  # sqrt(1 + ln(256/32) / ln 32)
    q = torch.randn(1, 4, 40, 8, generator=torch.Generator().manual_seed(0))
    # 32 positions use the short set, 33 the long one, for every position of the pass.
    for n, freqs in ((32, short_hf), (33, long_hf)):
        positions = torch.arange(n)[None]
        angles = positions[..., None].float() * freqs
        cos, sin = torch.cat([angles, angles], -1).cos() * attention, torch.cat([angles, angles], -1).sin() * attention
        x = q[:, :, :n]
        want = x * cos[:, None] + torch.cat([-x[..., 4:], x[..., :4]], -1) * sin[:, None]
        torch.testing.assert_close(rotary.rotate(x, positions), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("scaling", "message"), [
    ({"type": "yarn", "factor": 4.0}, "takes the keys"),
    ({"type": "yarn", "factor": 4.0, "original_max_len": 64, "truncate": "yes"}, "truncate must be True or False"),
    ({"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4, "original_max_len": 8},
     "short_factor must be a list of 4"),
    ({"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, float("nan"), 1.0],
      "original_max_len": 8}, "long_factor must be a list of 4"),
    ({"type": "dynamic", "factor": 2.0}, "unknown rotary scaling type 'dynamic'"),
])
def test_bad_scaling_options_are_named(scaling: dict, message: str) -> None:
    from blocks.positional import RotaryPositionalEncoding

    with pytest.raises(ValueError, match=message):
        RotaryPositionalEncoding(32, 4, scaling=scaling)
