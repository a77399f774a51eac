"""FFNs, norms, sublayer connections, and the encoder/decoder layers built from them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import blocks
from blocks import DecoderLayer, EncoderLayer, LayerCache
from tests import strategies as zst
from tests.blocks.test_moe import moe_reference

TOL = {"atol": 1e-5, "rtol": 1e-5}


def frozen(module: nn.Module) -> nn.Module:
    return module.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------------------
# Feed-forward networks
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", blocks.names("ffn"))
@given(d_model=st.integers(1, 16), d_ff=st.integers(1, 24), lead=st.lists(st.integers(1, 3), max_size=3),
       seed=zst.SEEDS)
def test_every_ffn_maps_d_model_to_d_model(name: str, d_model: int, d_ff: int, lead: list[int], seed: int) -> None:
    ffn = frozen(blocks.build("ffn", name, d_model=d_model, d_ff=d_ff))
    x = zst.randn((*lead, d_model), seed)
    out = ffn(x)
    assert out.shape == x.shape and out.isfinite().all()
    # Position-wise (§3.3): each position is transformed independently.
    if lead:
        torch.testing.assert_close(out[..., :1, :], ffn(x[..., :1, :]), **TOL)


def ffn_formula(name: str, ffn: nn.Module, x: Tensor) -> Tensor:
    """The papers' formulas written out with the module's weights."""
    def lin(layer: nn.Linear, h: Tensor) -> Tensor:
        return h @ layer.weight.T + (0 if layer.bias is None else layer.bias)

    activations = {
        "relu": lambda h: torch.clamp(h, min=0),  # max(0, x W1 + b1) W2 + b2
        "gelu": lambda h: 0.5 * h * (1 + torch.erf(h / 2**0.5)),
        "gelu_tanh": lambda h: 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3))),
        "swiglu": lambda h: h * torch.sigmoid(h),
        "geglu": lambda h: 0.5 * h * (1 + torch.erf(h / 2**0.5)),
        "geglu_tanh": lambda h: 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3))),
        "silu": lambda h: h * torch.sigmoid(h),
    }
    if name == "moe":  # routed experts: the per-token brute force of tests/blocks/test_moe.py
        return moe_reference(ffn, x)
    if name == "clamped_swiglu":  # gpt-oss: (clamp(x V, ±7) + 1) · g σ(1.702 g) with g = min(x W, 7), then W2
        g = lin(ffn.gate_proj, x).clamp(max=7.0)
        return lin(ffn.down_proj, (lin(ffn.up_proj, x).clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g))
    if name not in activations:
        pytest.fail(f"ffn {name!r} is registered but test_layers.py has no formula for it")
    act = activations[name]
    if hasattr(ffn, "gate_proj"):  # GLU variants (Shazeer 2020): (act(x W) * x V) W2
        return lin(ffn.down_proj, act(lin(ffn.gate_proj, x)) * lin(ffn.up_proj, x))
    return lin(ffn.down_proj, act(lin(ffn.up_proj, x)))


@pytest.mark.parametrize("name", blocks.names("ffn"))
def test_ffn_equals_its_formula(name: str) -> None:
    ffn = frozen(blocks.build("ffn", name, d_model=6, d_ff=10))
    x = torch.randn(2, 5, 6)
    torch.testing.assert_close(ffn(x), ffn_formula(name, ffn, x), **TOL)
    assert hasattr(ffn, "gate_proj") == ("glu" in name)


def test_relu_ffn_is_the_papers_network() -> None:
    ffn = frozen(blocks.build("ffn", "relu", d_model=4, d_ff=8))
    x = torch.randn(3, 4)
    w1, b1, w2, b2 = ffn.up_proj.weight, ffn.up_proj.bias, ffn.down_proj.weight, ffn.down_proj.bias
    expected = torch.maximum(x @ w1.T + b1, torch.zeros(())) @ w2.T + b2
    torch.testing.assert_close(ffn(x), expected, **TOL)
    assert w1.shape == (8, 4) and w2.shape == (4, 8)


@pytest.mark.parametrize("name", blocks.names("ffn"))
def test_ffn_bias_flag_and_dropout(name: str) -> None:
    ffn = blocks.build("ffn", name, d_model=4, d_ff=8, bias=False, dropout=0.5)
    assert all(p.dim() == 2 for p in ffn.parameters())  # no biases
    x = torch.randn(4, 6, 4)
    ffn.eval()
    eval_out = ffn(x)
    torch.testing.assert_close(ffn(x), eval_out)
    ffn.train()
    assert not torch.allclose(ffn(x), eval_out)


@pytest.mark.parametrize("name", blocks.names("ffn"))
def test_ffn_rejects_bad_sizes(name: str) -> None:
    with pytest.raises(ValueError, match="d_ff=0"):
        blocks.build("ffn", name, d_model=4, d_ff=0)


# ----------------------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", blocks.names("norm"))
@given(d_model=st.integers(2, 16), seed=zst.SEEDS)
def test_every_norm_keeps_the_shape_and_normalises_the_scale(name: str, d_model: int, seed: int) -> None:
    # float64 and a tiny eps: the properties below are exact up to rounding, even for nearly constant rows.
    norm = frozen(blocks.build("norm", name, d_model=d_model, eps=1e-12)).double()
    x = (zst.randn((2, 3, d_model), seed) * 5 + 1).double()
    out = norm(x)
    assert out.shape == x.shape
    if name == "identity":  # the norm that does not normalise
        assert torch.equal(out, x)
        return
    # Unit weight at init: the output has unit RMS (layernorm: about the mean, which it removes).
    rms = out.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=1e-3)
    # Invariant to rescaling the input.
    torch.testing.assert_close(norm(3 * x), out, **TOL)


def test_layernorm_and_rmsnorm_formulas() -> None:
    x = torch.randn(2, 5, 6)
    ln = blocks.build("norm", "layernorm", d_model=6, eps=1e-5)
    rms = blocks.build("norm", "rmsnorm", d_model=6, eps=1e-6)
    with torch.no_grad():
        for p in [*ln.parameters(), *rms.parameters()]:
            p.copy_(torch.randn_like(p))
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        torch.testing.assert_close(ln(x), (x - mean) / torch.sqrt(var + 1e-5) * ln.weight + ln.bias, **TOL)
        expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
        torch.testing.assert_close(rms(x), expected, **TOL)
    assert {n for n, _ in rms.named_parameters()} == {"weight"}
    assert {n for n, _ in ln.named_parameters()} == {"weight", "bias"}


# ----------------------------------------------------------------------------------------------------------
# Sublayer connections
# ----------------------------------------------------------------------------------------------------------


def around(connection: nn.Module, x: Tensor, sublayer) -> Tensor:
    """A sublayer connection applied around ``sublayer`` as the layers apply it."""
    return connection.residual(x, sublayer(connection.normalize(x)))


@pytest.mark.parametrize("norm_name", [n for n in blocks.names("norm") if n != "identity"])
def test_sublayer_formulas(norm_name: str) -> None:
    f = nn.Linear(6, 6)
    x = torch.randn(2, 4, 6)
    built = {
        name: frozen(blocks.build("sublayer", name, norm=blocks.build("norm", norm_name, d_model=6), dropout=0.5))
        for name in ("post_norm", "pre_norm", "sandwich_norm")
    }
    post, pre, sandwich = built["post_norm"], built["pre_norm"], built["sandwich_norm"]
    with torch.no_grad():
        for p in (p for c in built.values() for p in c.parameters()):
            p.copy_(torch.randn_like(p))
        torch.testing.assert_close(around(post, x, f), post.norm(x + f(x)), **TOL)  # §3.1: LayerNorm(x + Sublayer(x))
        torch.testing.assert_close(around(pre, x, f), x + f(pre.norm(x)), **TOL)
        # Gemma 2: a second norm, with its own weights, on the sublayer's output before the residual sum.
        torch.testing.assert_close(around(sandwich, x, f), x + sandwich.post_norm(f(sandwich.norm(x))), **TOL)
        assert sandwich.post_norm is not sandwich.norm and type(sandwich.post_norm) is type(sandwich.norm)
        assert not torch.allclose(around(post, x, f), around(pre, x, f))
        assert not torch.allclose(around(sandwich, x, f), around(pre, x, f))


def test_sublayer_dropout_applies_to_the_sublayer_output_in_training() -> None:
    x = torch.randn(4, 8, 6)
    pre = blocks.build("sublayer", "pre_norm", norm=blocks.build("norm", "layernorm", d_model=6), dropout=0.5)
    pre.train()
    torch.manual_seed(3)
    out = around(pre, x, lambda h: torch.ones_like(h))
    # Dropout(1) is 0 or 2: the residual x survives exactly, the sublayer output is dropped or doubled.
    assert set((out - x).round(decimals=4).unique().tolist()) == {0.0, 2.0}


@pytest.mark.parametrize("name", blocks.names("sublayer"))
def test_every_sublayer_keeps_the_shape(name: str) -> None:
    sub = frozen(blocks.build("sublayer", name, norm=blocks.build("norm", "rmsnorm", d_model=5)))
    x = torch.randn(2, 3, 5)
    assert around(sub, x, torch.tanh).shape == x.shape
    assert isinstance(sub.norm, blocks.get("norm", "rmsnorm"))


# ----------------------------------------------------------------------------------------------------------
# Encoder / decoder layers
# ----------------------------------------------------------------------------------------------------------


@st.composite
def layer_configs(draw: st.DrawFn) -> dict:
    # d_model >= 4: a LayerNorm over 2 features outputs only +-1, which hides any change of its input.
    dims = draw(zst.model_dims(max_heads=4, max_d_head=4).filter(lambda d: d["d_model"] >= 4))
    return {
        **dims,
        "d_ff": draw(st.integers(1, 16)),
        "ffn": draw(zst.registry_names("ffn")),
        "norm": draw(zst.registry_names("norm")),
        "sublayer": draw(zst.registry_names("sublayer")),
        "bias": draw(st.booleans()),
    }


@settings(max_examples=15)
@given(cfg=layer_configs(), n_layers=st.integers(1, 3), b=st.integers(1, 3), length=st.integers(1, 10),
       data=st.data())
def test_encoder_stack_is_permutation_equivariant(cfg: dict, n_layers: int, b: int, length: int,
                                                  data: st.DataObject) -> None:
    layers = [frozen(blocks.build("layer", "encoder", **cfg)) for _ in range(n_layers)]
    x = zst.randn((b, length, cfg["d_model"]), data.draw(zst.SEEDS))
    keep = data.draw(zst.padding_masks(b, length))
    perm = torch.tensor(data.draw(st.permutations(range(length))))

    def encode(h: Tensor, keep: Tensor) -> Tensor:
        for layer in layers:
            h, _ = layer(h, mask=blocks.padding_mask(keep))
        return h

    out = encode(x, keep)
    assert out.shape == x.shape and out.isfinite().all()
    torch.testing.assert_close(encode(x[:, perm], keep[:, perm]), out[:, perm], **TOL)


@settings(max_examples=10)
@given(cfg=layer_configs(), b=st.integers(1, 2), length=st.integers(1, 8), memory_len=st.integers(1, 8),
       cross=st.booleans(), data=st.data())
def test_decoder_layer_is_causal(cfg: dict, b: int, length: int, memory_len: int, cross: bool,
                                 data: st.DataObject) -> None:
    layer = frozen(blocks.build("layer", "decoder", **cfg, cross_attention=cross))
    seed = data.draw(zst.SEEDS)
    x = zst.randn((b, length, cfg["d_model"]), seed)
    memory = zst.randn((b, memory_len, cfg["d_model"]), seed + 1) if cross else None
    cut = data.draw(st.integers(0, length - 1))
    x2 = x.clone()
    x2[:, cut:] = zst.randn(x2[:, cut:].shape, seed + 2)
    out, _, _ = layer(x, memory)
    out2, _, _ = layer(x2, memory)
    assert out.shape == x.shape
    torch.testing.assert_close(out2[:, :cut], out[:, :cut], **TOL)
    assert not torch.allclose(out2[:, cut:], out[:, cut:])


@pytest.mark.parametrize("sublayer", blocks.names("sublayer"))
@pytest.mark.parametrize("cross", [True, False])
def test_decoder_layer_with_cache_equals_the_full_forward(sublayer: str, cross: bool) -> None:
    layer = frozen(blocks.decoder_layer(d_model=8, n_heads=4, n_kv_heads=2, d_ff=16, ffn="swiglu", norm="rmsnorm",
                                        sublayer=sublayer, cross_attention=cross))
    pe = blocks.build("positional", "rotary", d_model=8, n_heads=4)
    b, length = 2, 6
    x = torch.randn(b, length, 8)
    memory = torch.randn(b, 5, 8) if cross else None
    memory_mask = blocks.padding_mask(torch.tensor([[True] * 5, [True, True, True, False, False]])) if cross else None
    positions = torch.arange(length).expand(b, length)
    full, _, _ = layer(x, memory, memory_mask=memory_mask, rotary=pe, positions=positions)
    cache = LayerCache(max_len=length, cross=cross)
    steps = []
    for t in range(length):
        out, _, _ = layer(x[:, t : t + 1], memory, memory_mask=memory_mask, rotary=pe,
                          positions=positions[:, t : t + 1], cache=cache)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_layer_weights_are_returned_on_request() -> None:
    enc = frozen(blocks.encoder_layer(d_model=8, n_heads=2, d_ff=8))
    x = torch.randn(2, 5, 8)
    out, weights = enc(x, need_weights=True)
    assert weights.shape == (2, 2, 5, 5)
    torch.testing.assert_close(out, enc(x)[0], **TOL)
    assert enc(x)[1] is None
    dec = frozen(blocks.decoder_layer(d_model=8, n_heads=2, d_ff=8))
    out, self_w, cross_w = dec(x, torch.randn(2, 3, 8), need_weights=True)
    assert self_w.shape == (2, 2, 5, 5) and cross_w.shape == (2, 2, 5, 3)
    assert torch.equal(self_w.triu(1), torch.zeros_like(self_w))  # decoder self-attention is causal


def test_layer_builders_compose_the_named_blocks() -> None:
    enc = blocks.build("layer", "encoder", d_model=8, n_heads=4, n_kv_heads=1, d_ff=12, ffn="geglu", norm="rmsnorm",
                       sublayer="pre_norm", attention_backend="chunked", bias=False)
    assert isinstance(enc, EncoderLayer)
    assert isinstance(enc.ffn, blocks.get("ffn", "geglu")) and enc.ffn.up_proj.weight.shape == (12, 8)
    assert isinstance(enc.self_attn, blocks.get("attention", "mha"))
    assert enc.self_attn.n_kv_heads == 1 and enc.self_attn.backend == "chunked"
    for sub in (enc.self_attn_sublayer, enc.ffn_sublayer):
        assert isinstance(sub, blocks.get("sublayer", "pre_norm"))
        assert isinstance(sub.norm, blocks.get("norm", "rmsnorm"))
    assert all(not name.endswith("bias") for name, _ in enc.named_parameters())

    dec = blocks.build("layer", "decoder", d_model=8, n_heads=2, d_ff=12)
    assert isinstance(dec, DecoderLayer) and dec.cross_attn is not None and dec.cross_attn_sublayer is not None
    gpt = blocks.build("layer", "decoder", d_model=8, n_heads=2, d_ff=12, cross_attention=False)
    assert gpt.cross_attn is None and gpt.cross_attn_sublayer is None
    assert not any(name.startswith("cross") for name, _ in gpt.named_parameters())
    # The defaults are the paper's base layer: post-norm, LayerNorm, ReLU FFN.
    assert isinstance(dec.ffn, blocks.get("ffn", "relu"))
    assert isinstance(dec.ffn_sublayer, blocks.get("sublayer", "post_norm"))
    assert isinstance(dec.ffn_sublayer.norm, blocks.get("norm", "layernorm"))


def test_encoder_layer_equals_its_composition() -> None:
    enc = frozen(blocks.encoder_layer(d_model=8, n_heads=2, d_ff=16, sublayer="post_norm"))
    x = torch.randn(2, 5, 8)
    keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    mask = blocks.padding_mask(keep)
    h = enc.self_attn_sublayer.norm(x + enc.self_attn(x, mask=mask)[0])
    expected = enc.ffn_sublayer.norm(h + enc.ffn(h))
    torch.testing.assert_close(enc(x, mask=mask)[0], expected, **TOL)


@pytest.mark.parametrize(
    ("kind", "cfg", "match"),
    [
        ("encoder", {"d_model": 8, "n_heads": 2, "d_ff": 8, "ffn": "nope"}, "nope"),
        ("encoder", {"d_model": 8, "n_heads": 2, "d_ff": 8, "norm": "batchnorm"}, "batchnorm"),
        ("decoder", {"d_model": 8, "n_heads": 2, "d_ff": 8, "sublayer": "sandwich"}, "sandwich"),
        ("decoder", {"d_model": 8, "n_heads": 2, "d_ff": 8, "attention_backend": "fast"}, "fast"),
        ("encoder", {"d_model": 10, "n_heads": 4, "d_ff": 8}, "d_model=10"),
        ("decoder", {"d_model": 8, "n_heads": 2, "d_ff": 8, "cross": True}, "cross"),
    ],
)
def test_layer_builders_reject_bad_configs(kind: str, cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        blocks.build("layer", kind, **cfg)


def test_decoder_layer_needs_cross_attention_and_its_sublayer_together() -> None:
    mha = blocks.build("attention", "mha", d_model=4, n_heads=1)
    sub = blocks.build("sublayer", "pre_norm", norm=blocks.build("norm", "layernorm", d_model=4))
    with pytest.raises(ValueError, match="cross_attn"):
        DecoderLayer(mha, nn.Identity(), sub, sub, cross_attn=mha)
