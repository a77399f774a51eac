"""The component registry: get / build / names / kinds, and its errors."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import blocks
from blocks import registry

EXPECTED_NAMES = {
    "attention_backend": ["chunked", "flex", "math", "sdpa"],
    "attention": ["mha"],
    "mask": ["causal", "document", "padding", "prefix_lm", "sliding_window"],
    "positional": ["alibi", "learned", "none", "rotary", "rotary_interleaved", "sinusoidal", "sinusoidal_concat",
                   "t5_relative"],
    "ffn": ["geglu", "geglu_tanh", "gelu", "gelu_tanh", "relu", "swiglu"],
    "norm": ["identity", "layernorm", "rmsnorm", "rmsnorm_offset"],
    "sublayer": ["post_norm", "pre_norm", "sandwich_norm"],
    "layer": ["decoder", "encoder", "parallel"],
    "adapter": ["lora"],
}

THROWAWAY = "test_registry_throwaway_kind"


@pytest.fixture
def throwaway_kind() -> Iterator[str]:
    """A component kind that exists only for one test and is removed from the registry afterwards."""
    assert THROWAWAY not in registry._REGISTRY
    yield THROWAWAY
    registry._REGISTRY.pop(THROWAWAY, None)


def test_kinds_lists_every_component_kind() -> None:
    assert set(EXPECTED_NAMES) <= set(blocks.kinds())
    assert blocks.kinds() == sorted(blocks.kinds())


@pytest.mark.parametrize("kind", sorted(EXPECTED_NAMES))
def test_names_include_the_documented_components(kind: str) -> None:
    names = blocks.names(kind)
    assert set(EXPECTED_NAMES[kind]) <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize(
    ("kind", "name", "obj"),
    [
        ("attention_backend", "math", blocks.backends.math_attention),
        ("attention_backend", "sdpa", blocks.backends.sdpa_attention),
        ("attention_backend", "chunked", blocks.backends.chunked_attention),
        ("attention_backend", "flex", blocks.backends.flex_attention_backend),
        ("attention", "mha", blocks.MultiHeadAttention),
        ("adapter", "lora", blocks.adapters.LoRA),
        ("mask", "causal", blocks.causal_mask),
        ("mask", "sliding_window", blocks.sliding_window_mask),
        ("mask", "prefix_lm", blocks.prefix_lm_mask),
        ("mask", "document", blocks.document_mask),
        ("mask", "padding", blocks.padding_mask),
        ("positional", "rotary", blocks.positional.RotaryPositionalEncoding),
        ("positional", "alibi", blocks.positional.ALiBiPositionalBias),
        ("positional", "sinusoidal", blocks.positional.SinusoidalPositionalEncoding),
        ("positional", "sinusoidal_concat", blocks.positional.ConcatSinusoidalPositionalEncoding),
        ("positional", "learned", blocks.positional.LearnedPositionalEmbedding),
        ("positional", "none", blocks.positional.NoPositionalEncoding),
        ("layer", "encoder", blocks.encoder_layer),
        ("layer", "decoder", blocks.decoder_layer),
    ],
)
def test_get_returns_the_registered_object(kind: str, name: str, obj: object) -> None:
    assert blocks.get(kind, name) is obj


@pytest.mark.parametrize("name", blocks.names("attention_backend"))
def test_every_backend_is_a_function_with_the_shared_signature(name: str) -> None:
    fn = blocks.get("attention_backend", name)
    assert inspect.isfunction(fn)
    params = inspect.signature(fn).parameters
    assert list(params)[:3] == ["q", "k", "v"]
    for keyword, default in [("mask", None), ("bias", None), ("is_causal", False), ("dropout_p", 0.0), ("scale", None)]:
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword
        assert params[keyword].default == default, keyword


@pytest.mark.parametrize("kind", ["ffn", "norm", "sublayer", "positional", "attention"])
def test_every_module_kind_registers_nn_module_classes(kind: str) -> None:
    for name in blocks.names(kind):
        obj = blocks.get(kind, name)
        assert inspect.isclass(obj) and issubclass(obj, nn.Module), (kind, name)


def test_build_constructs_with_the_config() -> None:
    ffn = blocks.build("ffn", "relu", d_model=6, d_ff=10)
    assert isinstance(ffn, blocks.get("ffn", "relu"))
    assert ffn.up_proj.weight.shape == (10, 6)
    norm = blocks.build("norm", "layernorm", d_model=5, eps=1e-3)
    assert norm.normalized_shape == (5,) and norm.eps == 1e-3
    layer = blocks.build("layer", "encoder", d_model=8, n_heads=2, d_ff=16, ffn="swiglu", norm="rmsnorm")
    assert isinstance(layer, blocks.EncoderLayer)
    assert isinstance(layer.ffn, blocks.get("ffn", "swiglu"))
    assert isinstance(layer.ffn_sublayer.norm, blocks.get("norm", "rmsnorm"))
    mask = blocks.build("mask", "causal", lq=3, lk=4)
    torch.testing.assert_close(mask, blocks.causal_mask(3, 4))


def test_unknown_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="no_such_ffn") as info:
        blocks.get("ffn", "no_such_ffn")
    for name in blocks.names("ffn"):
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match="no_such_norm"):
        blocks.build("norm", "no_such_norm", d_model=4)


def test_unknown_kind_raises() -> None:
    for call in (
        lambda: blocks.get("no_such_kind", "x"),
        lambda: blocks.names("no_such_kind"),
        lambda: blocks.build("no_such_kind", "x"),
    ):
        with pytest.raises(ValueError, match="no_such_kind"):
            call()


def test_unknown_config_key_is_rejected_and_named() -> None:
    with pytest.raises(ValueError, match="d_fff"):
        blocks.build("ffn", "relu", d_model=4, d_ff=8, d_fff=3)
    with pytest.raises(ValueError, match="typo_key"):
        blocks.build("layer", "encoder", d_model=8, n_heads=2, d_ff=16, typo_key=1)


def test_missing_required_config_key_is_rejected_and_named() -> None:
    with pytest.raises(ValueError, match="d_ff"):
        blocks.build("ffn", "relu", d_model=4)


def test_register_then_get_build_names(throwaway_kind: str) -> None:
    @blocks.register(throwaway_kind, "b")
    class B:
        def __init__(self, width: int) -> None:
            self.width = width

    @blocks.register(throwaway_kind, "a")
    def a(x: int = 1) -> int:
        return x + 1

    assert throwaway_kind in blocks.kinds()
    assert blocks.names(throwaway_kind) == ["a", "b"]
    assert blocks.get(throwaway_kind, "b") is B
    assert blocks.build(throwaway_kind, "b", width=3).width == 3
    assert blocks.build(throwaway_kind, "a", x=4) == 5
    with pytest.raises(ValueError, match="height"):
        blocks.build(throwaway_kind, "b", width=3, height=2)


def test_duplicate_registration_raises(throwaway_kind: str) -> None:
    @blocks.register(throwaway_kind, "dup")
    def first() -> None: ...

    with pytest.raises(ValueError, match="dup"):

        @blocks.register(throwaway_kind, "dup")
        def second() -> None: ...

    assert blocks.get(throwaway_kind, "dup") is first


def test_duplicate_of_a_real_component_raises_and_keeps_the_original() -> None:
    original = blocks.get("ffn", "relu")
    with pytest.raises(ValueError, match="relu"):
        blocks.register("ffn", "relu")(object)
    assert blocks.get("ffn", "relu") is original


def test_throwaway_kind_was_cleaned_up() -> None:
    assert THROWAWAY not in blocks.kinds()
