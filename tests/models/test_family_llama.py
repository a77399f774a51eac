"""Llama, Mistral, Qwen2 and Qwen3 checkpoints against ``transformers`` (logits, generation, export)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import build_hf, check_decoder_family

VOCAB = 251  # odd, prime
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=False),
    dict(tie_word_embeddings=True, head_dim=12, rope_theta=500000.0),
    dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}),
    dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True),
    dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                       "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False}),
], ids=["untied", "tied-head_dim-theta", "llama3-scaling", "linear-scaling-bias", "yarn", "yarn-mscale-no-truncate"])
def test_llama(overrides: dict, tmp_path: Path) -> None:
    check_decoder_family(build_hf("LlamaConfig", "LlamaForCausalLM", **{**BASE, **overrides}), tmp_path, VOCAB)


def test_mistral_sliding_window_shorter_than_the_sequence(tmp_path: Path) -> None:
    hf = build_hf("MistralConfig", "MistralForCausalLM", **BASE, sliding_window=5)
    zoo = check_decoder_family(hf, tmp_path, VOCAB, length=24)
    assert zoo.layers[0].self_attn.window == 5


def test_qwen2_biases_on_qkv_only(tmp_path: Path) -> None:
    hf = build_hf("Qwen2Config", "Qwen2ForCausalLM", **BASE, tie_word_embeddings=True)
    zoo = check_decoder_family(hf, tmp_path, VOCAB)
    attn = zoo.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None and zoo.layers[0].ffn.up_proj.bias is None


def test_qwen2_sliding_window_layers(tmp_path: Path) -> None:
    hf = build_hf("Qwen2Config", "Qwen2ForCausalLM", **{**BASE, "num_hidden_layers": 3}, use_sliding_window=True,
                  sliding_window=4, max_window_layers=1)
    zoo = check_decoder_family(hf, tmp_path, VOCAB)
    assert [layer.self_attn.window for layer in zoo.layers] == [None, 4, 4]


def test_qwen3_qk_norm(tmp_path: Path) -> None:
    hf = build_hf("Qwen3Config", "Qwen3ForCausalLM", **BASE, head_dim=16)
    zoo = check_decoder_family(hf, tmp_path, VOCAB)
    assert zoo.layers[0].self_attn.q_norm is not None


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "proportional"}])
def test_unrepresentable_rope_scaling_is_refused_by_name(rope: dict) -> None:
    hf = build_hf("LlamaConfig", "LlamaForCausalLM", **BASE)
    config, state = hf.config.to_dict(), hf.state_dict()
    config["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=rope["rope_type"]):
        from_transformers(config, state)


def test_old_style_config_fields_load(tmp_path: Path) -> None:
    """config.json files written before transformers 5 carry rope_theta / rope_scaling at the top level."""
    hf = build_hf("LlamaConfig", "LlamaForCausalLM", **BASE, rope_theta=20000.0)
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    config.update(rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0})
    converted = from_transformers(config, hf.state_dict())
    assert converted.config.options["positional"] == {"base": 20000.0, "scaling": {"type": "linear", "factor": 2.0}}


def test_out_of_vocabulary_special_ids_load_as_none() -> None:
    """Tiny test checkpoints often keep a config class's default ids (GPT-2's 50256) with a small vocabulary."""
    hf = build_hf("LlamaConfig", "LlamaForCausalLM", **{**BASE, "bos_token_id": 50256, "eos_token_id": 50256})
    with pytest.warns(UserWarning, match="bos_token_id=50256"):
        converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    assert converted.config.bos_token_id is None and converted.config.eos_token_id is None
    gpt2 = build_hf("GPT2Config", "GPT2LMHeadModel", vocab_size=99, n_embd=32, n_layer=1, n_head=2)
    with pytest.warns(UserWarning, match="outside its vocabulary"):
        assert from_transformers(gpt2.config.to_dict(), gpt2.state_dict()).config.eos_token_id is None


def test_export_refuses_what_llama_cannot_represent() -> None:
    model = models.DecoderLM.from_preset("llama-tiny", options={"attention": {"softcap": 30.0}})
    with pytest.raises(ValueError, match="softcap"):
        to_transformers(model, "llama")
    model = models.DecoderLM.from_preset("tiny")  # GPT-2 shaped: learned positions
    with pytest.raises(ValueError, match="positional"):
        to_transformers(model, "llama")


@pytest.mark.parametrize("preset", ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_presets_export_to_their_family_and_back(preset: str) -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset(preset).eval()
    family = preset.removesuffix("-tiny")
    config, state = to_transformers(model, family)
    back = from_transformers(config, state)
    # The same config, up to options the export spells out (rotary's default base).
    defaults = {"positional": {"base": 10000.0}}
    assert back.config.replace(options={}) == model.config.replace(options={})
    for key in {*back.config.options, *model.config.options}:
        assert back.config.block_options(key) == {**defaults.get(key, {}), **model.config.block_options(key)}
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
