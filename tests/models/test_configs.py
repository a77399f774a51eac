"""Config round trips and validation; bad input to the models."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import blocks
from models import DecoderLM, DecoderLMConfig, EncoderLM, EncoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer

CONFIGS = [DecoderLMConfig, EncoderLMConfig, Seq2SeqConfig]
MODELS = [DecoderLM, EncoderLM, Seq2SeqTransformer]


@pytest.mark.parametrize("cls", CONFIGS)
@given(data=st.data())
def test_config_round_trip(cls, data):
    n_heads = data.draw(st.sampled_from([1, 2, 4, 8]))
    config = cls(
        vocab_size=data.draw(st.integers(10, 5000)),
        d_model=8 * data.draw(st.integers(1, 16)),
        n_heads=n_heads,
        n_kv_heads=data.draw(st.sampled_from([h for h in (1, 2, 4, 8) if n_heads % h == 0])),
        dropout=data.draw(st.floats(0, 0.9)),
        positional=data.draw(st.sampled_from(blocks.names("positional"))),
        ffn=data.draw(st.sampled_from(blocks.names("ffn"))),
        norm=data.draw(st.sampled_from(blocks.names("norm"))),
        sublayer=data.draw(st.sampled_from(blocks.names("sublayer"))),
        attention_backend=data.draw(st.sampled_from(blocks.names("attention_backend"))),
        tie_embeddings=data.draw(st.booleans()),
    )
    as_json = json.loads(json.dumps(config.to_dict()))
    assert cls.from_dict(as_json) == config
    assert cls.from_dict(as_json).to_dict() == config.to_dict()


@pytest.mark.parametrize("cls", CONFIGS)
def test_config_defaults_are_filled_in(cls):
    config = cls(d_model=64, n_heads=4)
    assert (config.n_kv_heads, config.d_head, config.d_value) == (4, 16, 16)
    with pytest.raises(dataclass_error()):
        config.d_model = 3  # frozen


def dataclass_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("cls", CONFIGS)
def test_from_dict_rejects_unknown_keys(cls):
    with pytest.raises(ValueError, match="n_layer"):
        cls.from_dict({**cls().to_dict(), "n_layer": 3})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"d_model": 30, "n_heads": 4}, "d_model=30 is not divisible by n_heads=4"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_heads=4 must be divisible by n_kv_heads=3"),
        ({"ffn": "rellu"}, "ffn='rellu' is not a registered ffn"),
        ({"positional": "abs"}, "positional='abs'"),
        ({"attention_backend": "cuda"}, "attention_backend='cuda'"),
        ({"norm": "batchnorm"}, "norm='batchnorm'"),
        ({"sublayer": "sandwich"}, "sublayer='sandwich'"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        ({"d_ff": -4}, "d_ff must be a positive integer, got -4"),
        ({"d_model": 1.5}, "d_model must be a positive integer, got 1.5"),
        ({"dropout": 1.0}, "dropout must be a float in \\[0, 1\\), got 1.0"),
        ({"pad_token_id": 5000}, "pad_token_id=5000"),
        ({"max_len": 0}, "max_len must be a positive integer"),
        ({"norm_eps": float("nan")}, "norm_eps must be a finite"),
        ({"norm_eps": float("inf")}, "norm_eps must be a finite"),
        ({"tie_embeddings": "false"}, "tie_embeddings must be a bool, got 'false'"),
        ({"bias": "False"}, "bias must be a bool, got 'False'"),
        ({"pad_token_id": True}, "pad_token_id must be an int or None, got True"),
        ({"n_heads": True}, "n_heads must be a positive integer, got True"),
        ({"options": {"positional": {"d_model": 8}}}, "set by the model itself"),
        ({"options": {"attention": {"windw": 4}}}, "unknown config key\\(s\\) \\['windw'\\]"),
        ({"options": {"rotary": {"base": 4}}}, "unknown block\\(s\\) \\['rotary'\\]"),
        ({"options": {"attention": 4}}, "must map block names to dicts"),
        ({"layer_options": [{"ffn": {"nope": 1}}]}, "layer_options\\[0\\]"),
        ({"logit_softcap": 0.0}, "logit_softcap"),
    ],
)
@pytest.mark.parametrize("cls", CONFIGS)
def test_invalid_configs_raise_at_construction(cls, changes, message):
    with pytest.raises(ValueError, match=message):
        cls(**changes)


def test_block_options_round_trip_and_reach_the_blocks():
    options = {"positional": {"base": 500000.0, "fraction": 0.5}, "attention": {"softcap": 20.0, "window": 3},
               "norm": {"bias": False}, "layer": {"attention_norm": "identity"}}
    config = DecoderLMConfig(positional="rotary", d_model=32, n_heads=2, n_layers=2, options=options,
                             layer_options=[{"attention": {"window": 5}}, {"positional": {"base": 100.0}}])
    again = DecoderLMConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.options == options
    model = DecoderLM(config)
    assert model.positional.dim == 8 and model.layers[0].self_attn.softcap == 20.0
    assert [layer.self_attn.window for layer in model.layers] == [5, 3]
    assert model.layers[0].ffn_sublayer.norm.bias is None and isinstance(model.layers[0].self_attn_sublayer.norm,
                                                                        blocks.get("norm", "identity"))
    torch.testing.assert_close(model.layer_positionals["1"].inv_freq[0], torch.tensor(1.0))
    assert "0" not in model.layer_positionals
    with pytest.raises(ValueError, match="one per layer"):
        config.replace(n_layers=3)


# ------------------------------------------------------------------------------- typed, finite block options
#: wrong values for each plain annotation (written here, not taken from the code under test).
BAD_VALUES = {
    "bool": ["false", 1, None],
    "int": [True, 2.5, "3", None],
    "float": [float("inf"), float("-inf"), float("nan"), "1.0", True, None],
    "str": [1, True, None],
    "Mapping": ["linear", [1.0], None],
}


def typed_options():
    """(config key, block field, block name, option, plain annotation) for every option of every registered block
    a config names, and of the layer builders (generated over the registries: a new block joins the test)."""
    from blocks.layers import SUPPLIED
    from models.core.config import LAYER_BUILDER_SUPPLIED, POSITIONAL_SUPPLIED

    cases = []
    targets = [(key, field, kind, name) for key, (field, kind) in DecoderLMConfig.option_blocks.items()
               for name in blocks.names(kind) if kind != "head" or name in DecoderLMConfig.heads]
    targets += [("layer", None, "layer", name) for name in DecoderLMConfig().layer_builders()]
    for key, field, kind, name in targets:
        supplied = {"positional": POSITIONAL_SUPPLIED, "layer": LAYER_BUILDER_SUPPLIED}.get(kind) or SUPPLIED[kind]
        for option, param in inspect.signature(blocks.get(kind, name)).parameters.items():
            if option in supplied or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                continue
            text = str(param.annotation)
            optional = text.endswith(" | None")
            base = text.removesuffix(" | None").split("[")[0].replace("dict", "Mapping")
            if base in BAD_VALUES:
                cases.append(pytest.param(key, field, name, option, base, optional, id=f"{kind}-{name}-{option}"))
    return cases


@pytest.mark.parametrize(("key", "field", "name", "option", "base", "optional"), typed_options())
def test_block_options_are_typed_and_finite(key, field, name, option, base, optional):
    select = {} if field is None else {field: name}
    for bad in BAD_VALUES[base]:
        if bad is None and optional:
            continue
        message = f"{option!r} of options\\[{key!r}\\].*{name!r}.*got {re.escape(repr(bad))}"
        with pytest.raises(ValueError, match=message):
            DecoderLMConfig(**select, options={key: {option: bad}})
        with pytest.raises(ValueError, match=f"layer_options\\[0\\]\\[{key!r}\\].*{re.escape(repr(bad))}"):
            DecoderLMConfig(**select, n_layers=1, layer_options=[{key: {option: bad}}])
    default = inspect.signature(blocks.get("layer" if field is None else DecoderLMConfig.option_blocks[key][1],
                                           name)).parameters[option].default
    if default is not inspect.Parameter.empty:  # the block's own default is a valid option value
        assert DecoderLMConfig(**select, options={key: {option: default}}).options[key][option] == default


def test_nested_option_values_must_be_finite():
    with pytest.raises(ValueError, match="'scaling' of options\\['positional'\\].*finite.*inf"):
        DecoderLMConfig(positional="rotary", options={"positional": {"scaling": {"rope_type": "linear",
                                                                                  "factor": float("inf")}}})
    # An int where a float is expected is a float; a bool never is an int or a float.
    assert DecoderLMConfig(options={"attention": {"scale": 1}}).options == {"attention": {"scale": 1}}


def test_old_config_files_without_options_load():
    old = DecoderLMConfig().to_dict()
    for key in ("options", "layer_options", "scale_embeddings", "logit_softcap", "output_scale", "layer"):
        old.pop(key)
    assert DecoderLMConfig.from_dict(old) == DecoderLMConfig()


def test_replace_derives_defaults_again():
    config = DecoderLMConfig(d_model=64, n_heads=4)
    assert (config.n_kv_heads, config.d_head) == (4, 16)
    wider = config.replace(n_heads=8)
    assert (wider.n_kv_heads, wider.d_head, wider.d_value) == (8, 8, 8)
    gqa = DecoderLMConfig(d_model=64, n_heads=4, n_kv_heads=2).replace(n_heads=8)
    assert gqa.n_kv_heads == 2  # an explicit non-default value is kept


def test_family_specific_validation():
    with pytest.raises(ValueError, match="n_layers must be a positive integer, got 0"):
        DecoderLMConfig(n_layers=0)
    with pytest.raises(ValueError, match="n_decoder_layers"):
        Seq2SeqConfig(n_decoder_layers=-1)
    with pytest.raises(ValueError, match="type_vocab_size"):
        EncoderLMConfig(type_vocab_size=-1)
    with pytest.raises(TypeError, match="Seq2SeqConfig"):
        Seq2SeqTransformer(DecoderLMConfig())


def tiny(cls, **kw):
    return cls.from_preset("tiny", vocab_size=50, d_model=16, n_heads=2, d_ff=32, max_len=16, **kw).eval()


def call(model, x, mask=None):
    if isinstance(model, Seq2SeqTransformer):
        return model(x, x, src_mask=mask, tgt_mask=mask)
    return model(x, attention_mask=mask)


@pytest.mark.parametrize("cls", MODELS)
def test_ids_outside_the_vocabulary_raise(cls):
    model = tiny(cls)
    with pytest.raises(ValueError, match="contains id 50, outside the vocabulary \\[0, vocab_size=50\\)"):
        call(model, torch.tensor([[1, 2, 50]]))
    with pytest.raises(ValueError, match="contains id -1"):
        call(model, torch.tensor([[1, -1, 3]]))
    with pytest.raises(ValueError, match="integer token ids"):
        call(model, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="\\(B, L\\)"):
        call(model, torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("cls", MODELS)
def test_mask_shape_must_match_ids(cls):
    model = tiny(cls)
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="must have shape \\(1, 3\\)"):
        call(model, x, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool or 0/1"):
        call(model, x, torch.tensor([[1, 2, 1]]))
    # 0/1 integer masks (as tokenizers return them) are accepted.
    call(model, x, torch.tensor([[1, 1, 0]]))


@pytest.mark.parametrize("cls", MODELS)
def test_input_longer_than_learned_positions_raises(cls):
    model = tiny(cls, positional="learned")
    with pytest.raises(ValueError, match="position 16 is out of range .* max_len=16"):
        call(model, torch.ones(1, 17, dtype=torch.long))
    call(model, torch.ones(1, 16, dtype=torch.long))
    # Sinusoidal tables extend on demand instead.
    call(tiny(cls, positional="sinusoidal"), torch.ones(1, 40, dtype=torch.long))


def test_labels_and_segments_are_checked():
    model = tiny(EncoderLM)
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="labels must have shape"):
        model(x, labels=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="token_type_ids must be in \\[0, type_vocab_size=2\\)"):
        model(x, token_type_ids=torch.tensor([[0, 2, 0]]))
    with pytest.raises(ValueError, match="labels must have shape"):
        tiny(DecoderLM)(x, labels=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="labels must have shape"):
        tiny(Seq2SeqTransformer)(x, x, labels=torch.tensor([[1, 2]]))


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("shape", [(0, 5), (2, 0)])
def test_empty_batches_and_sequences_give_empty_logits(cls, shape):
    model = cls.from_preset("tiny", vocab_size=50, d_model=16, n_heads=2, d_ff=32).eval()
    ids = torch.zeros(shape, dtype=torch.long)
    out = model(ids, ids) if cls is Seq2SeqTransformer else model(ids)
    assert out.logits.shape == (*shape, 50)


@pytest.mark.parametrize("cls", MODELS)
def test_bad_labels_raise_and_all_ignored_labels_give_zero_loss(cls):
    model = cls.from_preset("tiny", vocab_size=50, d_model=16, n_heads=2, d_ff=32)
    ids = torch.randint(0, 50, (2, 6))

    def loss(labels):
        return (model(ids, ids, labels=labels) if cls is Seq2SeqTransformer else model(ids, labels=labels)).loss

    for bad, message in ((50, "contain 50, outside"), (-3, "contain -3, outside")):
        labels = ids.clone()
        labels[1, 2] = bad
        with pytest.raises(ValueError, match=message):
            loss(labels)
    with pytest.raises(ValueError, match="integer token ids"):
        loss(ids.float())
    ignored = loss(torch.full_like(ids, -100))
    assert ignored.item() == 0.0
    ignored.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    # and one real label is the plain cross-entropy at that position
    labels = torch.full_like(ids, -100)
    labels[0, 3] = 7
    model.eval()
    with torch.no_grad():
        out = model(ids, ids) if cls is Seq2SeqTransformer else model(ids)
        position = (0, 2) if cls is DecoderLM else (0, 3)  # DecoderLM predicts labels[t + 1] from position t
        expected = -torch.log_softmax(out.logits[position], -1)[7]
        torch.testing.assert_close(loss(labels), expected)
