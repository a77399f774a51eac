"""Phi-3 checkpoints against ``transformers`` (logits, generation, export) and its fused projections by hand."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, save_transformers, to_transformers
from tests.models import family_harness
from tests.models.family_harness import build_hf, check_decoder_family

VOCAB = 251  # odd, prime
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("overrides", [
    dict(sliding_window=5),
    dict(partial_rotary_factor=0.5, tie_word_embeddings=True, rope_parameters={"rope_theta": 500.0,
                                                                                "rope_type": "default"}),
], ids=["gqa-window", "partial-rotary-tied-theta"])
def test_phi3(overrides: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A Phi-3 computes what a Llama/Mistral does, so an export that picks the family itself writes one of those;
    # the round trip here must go through the phi3 exporter (fused qkv_proj / gate_up_proj).
    monkeypatch.setattr(family_harness, "save_transformers", functools.partial(save_transformers, model_type="phi3"))
    hf = build_hf("Phi3Config", "Phi3ForCausalLM", **{**BASE, **overrides})
    zoo = check_decoder_family(hf, tmp_path, VOCAB, length=24)
    assert zoo.layers[1].self_attn.window == overrides.get("sliding_window")
    assert zoo.positional.dim == int(8 * overrides.get("partial_rotary_factor", 1.0))


def test_fused_projections_split_in_order() -> None:
    """qkv_proj rows are [q (6·8); k (2·8); v (2·8)] and gate_up_proj rows [gate (80); up (80)]."""
    hf = build_hf("Phi3Config", "Phi3ForCausalLM", **BASE)
    converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    qkv = hf.model.layers[1].self_attn.qkv_proj.weight
    gate_up = hf.model.layers[1].mlp.gate_up_proj.weight
    zoo = converted.state_dict
    assert torch.equal(zoo["layers.1.self_attn.q_proj.weight"], qkv[:48])
    assert torch.equal(zoo["layers.1.self_attn.k_proj.weight"], qkv[48:64])
    assert torch.equal(zoo["layers.1.self_attn.v_proj.weight"], qkv[64:])
    assert torch.equal(zoo["layers.1.ffn.gate_proj.weight"], gate_up[:80])
    assert torch.equal(zoo["layers.1.ffn.up_proj.weight"], gate_up[80:])
    state = {**hf.state_dict(), "model.layers.0.mlp.gate_up_proj.weight": gate_up[:100]}
    with pytest.raises(ValueError, match="gate_up_proj"):
        from_transformers(hf.config.to_dict(), state)


LONGROPE = {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 6.0, 11.0]}


@pytest.mark.parametrize("rope", [
    {"rope_type": "longrope", **LONGROPE, "original_max_position_embeddings": 16},
    {"type": "su", **LONGROPE, "original_max_position_embeddings": 16},  # the older name
], ids=["longrope", "su"])
def test_long_context_rope_switches_factors_as_transformers(rope: dict, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # 24 positions against an original context of 16: the short factors below 16, the long ones past it, in the
    # full forward pass and during cached generation.
    monkeypatch.setattr(family_harness, "save_transformers", functools.partial(save_transformers, model_type="phi3"))
    hf = build_hf("Phi3Config", "Phi3ForCausalLM", **BASE, original_max_position_embeddings=16, rope_scaling=rope)
    zoo = check_decoder_family(hf, tmp_path, VOCAB, length=24)
    assert zoo.positional.switch_after == 16 and zoo.positional.attention_factor > 1.0


def test_other_rope_scaling_is_refused_by_name() -> None:
    hf = build_hf("Phi3Config", "Phi3ForCausalLM", **BASE)
    config = {**hf.config.to_dict(), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        from_transformers(config, hf.state_dict())


def test_export_refuses_what_phi3_cannot_represent() -> None:
    with pytest.raises(ValueError, match="bias"):
        to_transformers(models.DecoderLM.from_preset("qwen2-tiny"), "phi3")
    model = models.DecoderLM.from_preset("phi3-tiny", options={"positional": {"scaling": {"type": "linear",
                                                                                          "factor": 2.0}}})
    with pytest.raises(ValueError, match="RoPE scaling"):
        to_transformers(model, "phi3")


def test_preset_exports_to_phi3_and_back() -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("phi3-tiny").eval()
    config, state = to_transformers(model, "phi3")
    assert "model.layers.0.self_attn.qkv_proj.weight" in state and "model.layers.0.mlp.gate_up_proj.weight" in state
    back = from_transformers(config, state)
    assert back.config == model.config
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_phi_3_mini_4k_preset_shape() -> None:
    """Phi-3-mini-4k: 3,821,079,552 parameters (untied head), a 2047-token window in every layer."""
    with torch.device("meta"):
        model = models.DecoderLM.from_preset("phi-3-mini-4k")
    assert sum(p.numel() for p in model.parameters()) == 3_821_079_552
    assert {layer.self_attn.window for layer in model.layers} == {2047}


def test_loops_that_cannot_recompute_their_cache_refuse_to_cross_the_longrope_switch() -> None:
    from serving import Engine

    model = models.DecoderLM.from_preset("phi3-tiny", max_len=64, options={"positional": {"scaling": {
        "type": "longrope", "original_max_len": 16, "short_factor": [1.0 + i / 4 for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)]}}}).eval()
    prompt = torch.randint(3, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    for kwargs in ({"compile": True}, {"draft_model": model}):
        with pytest.raises(ValueError, match="cannot cross the LongRoPE switch at 16 positions"):
            model.generate(prompt, max_new_tokens=10, **kwargs)
    with pytest.raises(ValueError, match="the engine cannot cross the LongRoPE switch"):
        Engine(model).generate([prompt[0].tolist()], max_tokens=10)
    # Requests that stay on one side of the switch are served.
    assert Engine(model).generate([prompt[0].tolist()], max_tokens=5)[0].token_ids == \
        model.generate(prompt, max_new_tokens=5, eos_token_id=None)[0, 10:].tolist()
