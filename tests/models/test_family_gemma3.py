"""Gemma 3 text checkpoints against ``transformers`` (logits, generation, export): offset q/k norms, a rotary per
layer type (global base and linear scaling, local base), five sliding layers to one global one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import build_hf, check_decoder_family

VOCAB = 251  # odd, prime
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, sliding_window=5, query_pre_attn_scalar=20)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
         tie_word_embeddings=False, final_logit_softcapping=3.0),
], ids=["defaults", "linear-global-rope-untied-softcap"])
def test_gemma3(overrides: dict, tmp_path: Path) -> None:
    hf = build_hf("Gemma3TextConfig", "Gemma3ForCausalLM", **{**BASE, **overrides})
    zoo = check_decoder_family(hf, tmp_path, VOCAB, length=24)
    assert [layer.self_attn.window for layer in zoo.layers] == [5, 5, 5, 5, 5, None, 5]
    assert zoo.layers[0].self_attn.q_norm is not None and set(zoo.layer_positionals) == {"0", "1", "2", "3", "4", "6"}
    if overrides:
        assert zoo.positional.inv_freq[1] == pytest.approx(50000.0 ** (-2 / 16) / 4)
        assert zoo.layer_positionals["0"].inv_freq[1] == pytest.approx(500.0 ** (-2 / 16))


def test_preset_exports_to_gemma3_and_back() -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("gemma3-tiny").eval()
    config, state = to_transformers(model, "gemma3_text")
    assert config["model_type"] == "gemma3_text" and config["rope_parameters"]["sliding_attention"]["rope_theta"] \
        == 10000.0
    back = from_transformers(config, state)
    zoo = back.architecture(back.config)
    zoo.load_state_dict(back.state_dict)
    ids = torch.randint(3, 1000, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(zoo.eval()(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="offset RMSNorm on q and k"):
        to_transformers(models.DecoderLM.from_preset("gemma2-tiny"), "gemma3_text")


def test_gemma_3_1b_preset_shape() -> None:
    config = models.DecoderLM.config_class.from_dict(models.DecoderLM.presets["gemma-3-1b"])
    windows = [entry.get("attention", {}).get("window") for entry in config.layer_options]
    assert windows.count(None) == 4 and windows[5] is None and config.n_kv_heads == 1
