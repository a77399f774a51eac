"""GPT-NeoX checkpoints against ``transformers`` (logits, generation, export) and the fused q/k/v layout by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from models.convert.gpt_neox import fuse_query_key_value, split_query_key_value
from tests.models.family_harness import build_hf, check_decoder_family

VOCAB = 251  # odd, prime
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("overrides", [
    dict(),  # parallel residual, rotary_pct 0.25: 4 of each head's 16 dimensions rotate
    dict(use_parallel_residual=False, rotary_pct=0.5, rotary_emb_base=500.0, attention_bias=False),
    dict(tie_word_embeddings=True, rotary_pct=1.0, hidden_act="gelu_new"),
], ids=["parallel", "sequential-partial-nobias", "tied-full-rotary"])
def test_gpt_neox(overrides: dict, tmp_path: Path) -> None:
    hf = build_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **{**BASE, **overrides})
    zoo = check_decoder_family(hf, tmp_path, VOCAB)
    assert zoo.config.layer == ("decoder" if overrides.get("use_parallel_residual") is False else "parallel")
    assert zoo.positional.dim == int(zoo.config.d_head * overrides.get("rotary_pct", 0.25))


def test_fused_query_key_value_is_grouped_per_head() -> None:
    """Row r of query_key_value is head r // (3·d), part (r // d) % 3 (q, k, v), dimension r % d."""
    n_heads, d = 3, 2
    fused = torch.arange(3 * n_heads * d, dtype=torch.float32)
    q, k, v = split_query_key_value(fused, n_heads, d, "qkv")
    assert q.tolist() == [0, 1, 6, 7, 12, 13] and k.tolist() == [2, 3, 8, 9, 14, 15]
    assert v.tolist() == [4, 5, 10, 11, 16, 17]
    weight = torch.randn(3 * n_heads * d, 5)
    assert torch.equal(fuse_query_key_value(*split_query_key_value(weight, n_heads, d, "w"), n_heads, d), weight)
    with pytest.raises(ValueError, match="rows"):
        split_query_key_value(torch.zeros(17), n_heads, d, "qkv")


def test_pythia_style_file_with_old_fields_and_buffers_loads() -> None:
    """Published Pythia files: rotary_pct / rotary_emb_base fields, the head as embed_out, stale mask buffers."""
    hf = build_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **BASE, rotary_pct=0.5, rotary_emb_base=500.0)
    config = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    config.update(rotary_pct=0.5, rotary_emb_base=500.0)
    state = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in hf.state_dict().items()}
    state["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    state["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    converted = from_transformers(config, state)
    assert converted.config.options["positional"] == {"base": 500.0, "fraction": 0.5}
    model = models.DecoderLM(converted.config).eval()
    model.load_state_dict(converted.state_dict)
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


def test_base_model_checkpoint_leaves_the_head_missing() -> None:
    hf = build_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **BASE)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    converted = from_transformers(hf.config.to_dict(), state)
    assert converted.allow_missing == {"lm_head.weight"}


@pytest.mark.parametrize(("field", "value"), [("hidden_act", "mish"), ("rope_parameters", {"rope_type": "dynamic"})])
def test_unrepresentable_gpt_neox_fields_are_refused_by_name(field: str, value: object) -> None:
    hf = build_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **BASE)
    config = {**hf.config.to_dict(), field: value}
    with pytest.raises(ValueError, match="hidden_act|dynamic"):
        from_transformers(config, hf.state_dict())


def test_export_refuses_what_gpt_neox_cannot_represent() -> None:
    with pytest.raises(ValueError, match="norm"):
        to_transformers(models.DecoderLM.from_preset("llama-tiny"), "gpt_neox")
    with pytest.raises(ValueError, match="window"):
        to_transformers(models.DecoderLM.from_preset("gpt_neox-tiny", options={"attention": {"window": 4}}),
                        "gpt_neox")


@pytest.mark.parametrize("layer", ["parallel", "decoder"])
def test_preset_exports_to_gpt_neox_and_back(layer: str) -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("gpt_neox-tiny", layer=layer).eval()
    config, state = to_transformers(model, "gpt_neox")
    assert "embed_out.weight" in state
    back = from_transformers(config, state)
    assert back.config == model.config
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_pythia_160m_preset_shape() -> None:
    """Pythia-160M: 162,322,944 parameters (untied head)."""
    with torch.device("meta"):
        model = models.DecoderLM.from_preset("pythia-160m")
    assert sum(p.numel() for p in model.parameters()) == 162_322_944
