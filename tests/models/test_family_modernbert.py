"""ModernBERT checkpoints against ``transformers`` (logits with global/local layers, export, refusals)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import build_hf, check_encoder_family

VOCAB = 97  # odd, prime
# 4 layers: global, local, local, global (every third global); local layers see |i - j| <= 3, sequences are 20 long.
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=64, local_attention=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            cls_token_id=1, sep_token_id=2)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True, decoder_bias=False,
         tie_word_embeddings=False, local_attention=7, hidden_activation="gelu_pytorch_tanh",
         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}}),
    dict(attention_bias=True, classifier_bias=False, layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2),
], ids=["defaults", "biases-untied-tanh-bases", "mixed-biases-layer-types"])
def test_modernbert(overrides: dict, tmp_path: Path) -> None:
    hf = build_hf("ModernBertConfig", "ModernBertForMaskedLM", **{**BASE, **overrides})
    # BERT/RoBERTa/DistilBERT refuse rotary positions, so the default export is ModernBERT.
    zoo = check_encoder_family(hf, tmp_path, VOCAB, length=20)
    local = hf.config.local_attention // 2 + 1
    windows = [local if t == "sliding_attention" else None for t in hf.config.layer_types]
    assert [layer.self_attn.window for layer in zoo.layers] == windows


def test_layer_structure_and_rotary_bases() -> None:
    hf = build_hf("ModernBertConfig", "ModernBertForMaskedLM", **BASE)
    zoo = models.EncoderLM(from_transformers(hf.config.to_dict(), hf.state_dict()).config)
    assert isinstance(zoo.layers[0].self_attn_sublayer.norm, torch.nn.Identity)
    assert zoo.layers[1].self_attn_sublayer.norm.bias is None  # norm_bias=False
    # Local layers rotate with their own frequencies (transformers' sliding_attention ones), global with the stack's.
    rotary = hf.model.rotary_emb
    assert sorted(zoo.layer_positionals) == ["1", "2"]
    torch.testing.assert_close(zoo.positional.inv_freq, rotary.full_attention_inv_freq)
    for i in ("1", "2"):
        torch.testing.assert_close(zoo.layer_positionals[i].inv_freq, rotary.sliding_attention_inv_freq)


def test_fused_weights_split_as_transformers_computes() -> None:
    """Wqkv rows are q, k, v; Wi rows are [input; gate] with act(input) * gate: input is the zoo's gate_proj."""
    hf = build_hf("ModernBertConfig", "ModernBertForMaskedLM", **BASE)
    state = from_transformers(hf.config.to_dict(), hf.state_dict()).state_dict
    x = torch.randn(3, 48)
    with torch.no_grad():
        mlp = hf.model.layers[1].mlp
        expected = mlp(x)
        gate, up = state["layers.1.ffn.gate_proj.weight"], state["layers.1.ffn.up_proj.weight"]
        actual = torch.nn.functional.gelu(x @ gate.T) * (x @ up.T) @ state["layers.1.ffn.down_proj.weight"].T
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(state["layers.1.self_attn.k_proj.weight"], hf.model.layers[1].attn.Wqkv.weight[48:96])


def test_old_style_config_fields_load() -> None:
    """config.json files written before transformers 5 (ModernBERT-base's) carry global_attn_every_n_layers and
    global/local_rope_theta instead of layer_types and rope_parameters."""
    hf = build_hf("ModernBertConfig", "ModernBertForMaskedLM", **BASE)
    new = from_transformers(hf.config.to_dict(), hf.state_dict()).config
    config = {k: v for k, v in hf.config.to_dict().items() if k not in ("layer_types", "rope_parameters")}
    config.update(global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0)
    assert from_transformers(config, hf.state_dict()).config == new
    config.update(global_attn_every_n_layers=2, local_rope_theta=500.0)
    old = from_transformers(config, hf.state_dict()).config
    assert [bool(o.get("attention")) for o in old.layer_options] == [False, True, False, True]
    assert old.layer_options[1]["positional"] == {"base": 500.0}


def test_base_model_checkpoint_loads_without_head() -> None:
    hf = build_hf("ModernBertConfig", "ModernBertModel", **BASE)
    converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    assert {"mlm_head.dense.weight", "mlm_head.norm.weight", "mlm_head.decoder.bias"} <= converted.allow_missing


@pytest.mark.parametrize(("change", "match"), [
    (dict(classifier_activation="relu"), "classifier_activation"),
    (dict(hidden_activation="mish"), "hidden_activation"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "dynamic"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]), "layer_types"),
])
def test_unrepresentable_configs_are_refused_by_name(change: dict, match: str) -> None:
    hf = build_hf("ModernBertConfig", "ModernBertForMaskedLM", **BASE)
    with pytest.raises(ValueError, match=match):
        from_transformers({**hf.config.to_dict(), **change}, hf.state_dict())


def test_export_refuses_what_modernbert_cannot_represent() -> None:
    config = models.EncoderLM.preset_config("modernbert-tiny")
    no_identity = [dict(o) for o in config.layer_options]
    no_identity[0] = {}
    two_windows = [dict(o) for o in config.layer_options]
    two_windows[2] = {**two_windows[2], "attention": {"window": 3}}
    for layer_options, match in ((no_identity, "attention norm"), (two_windows, "different windows")):
        with pytest.raises(ValueError, match=match):
            to_transformers(models.EncoderLM(config.replace(layer_options=tuple(layer_options))), "modernbert")
    with pytest.raises(ValueError, match="ffn"):
        to_transformers(models.EncoderLM(config.replace(ffn="gelu")), "modernbert")


def test_preset_exports_to_modernbert_and_back() -> None:
    torch.manual_seed(0)
    model = models.EncoderLM.from_preset("modernbert-tiny").eval()
    config, state = to_transformers(model, "modernbert")
    assert config["local_attention"] == 16 and config["layer_types"][0] == "full_attention"
    back = from_transformers(config, state)
    assert back.config == model.config
    reloaded = models.EncoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    base = models.EncoderLM.preset_config("modernbert-base")
    assert sum("attention" in o for o in base.layer_options) == 14  # 22 layers, every third global
