"""OLMoE checkpoints against ``transformers``: logits, greedy generation, export, and the auxiliary loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import build_hf, check_decoder_family, from_live, left_padded

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py

VOCAB = 251  # odd, prime
# 7 experts (odd, not divisible by top_k), top-3, GQA (OLMoE's k norm spans n_kv_heads · d_head).
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            num_experts=7, num_experts_per_tok=3)


def test_olmoe_against_transformers(tmp_path: Path) -> None:
    hf = build_hf("OlmoeConfig", "OlmoeForCausalLM", **BASE)
    zoo = check_decoder_family(hf, tmp_path, VOCAB)
    attn, ffn = zoo.layers[0].self_attn, zoo.layers[0].ffn
    assert attn.q_norm.weight.shape == (48,) and attn.k_norm.weight.shape == (16,)  # the whole projections
    assert (ffn.n_experts, ffn.top_k, ffn.renormalize) == (7, 3, False)


def test_the_auxiliary_loss_equals_transformers_router_aux_loss_term() -> None:
    hf = build_hf("OlmoeConfig", "OlmoeForCausalLM", **BASE, norm_topk_prob=True, output_router_logits=True,
                  router_aux_loss_coef=0.2)
    zoo, converted = from_live(hf)  # fused experts of a live model
    assert converted.config.options["ffn"]["renormalize"] is True
    ids, mask = left_padded(VOCAB, 12)
    labels = ids.masked_fill(mask == 0, -100)
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
    assert expected.aux_loss > 0
    out = zoo(ids, attention_mask=mask.bool(), labels=labels)
    torch.testing.assert_close(out.logits[mask.bool()], expected.logits[mask.bool()], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=0)


def test_preset_exports_to_olmoe_and_back() -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("olmoe-tiny").eval()
    config, state = to_transformers(model, "olmoe")
    assert "head_dim" not in config and "model.layers.1.mlp.experts.5.up_proj.weight" in state
    back = from_transformers(config, state)
    assert back.config.replace(options={}) == model.config.replace(options={})
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_what_olmoe_cannot_represent_is_refused_by_name() -> None:
    hf = build_hf("OlmoeConfig", "OlmoeForCausalLM", **BASE)
    with pytest.raises(ValueError, match="clip_qkv=8.0"):
        from_transformers({**hf.config.to_dict(), "clip_qkv": 8.0}, hf.state_dict())
    per_head = models.DecoderLM.from_preset("olmoe-tiny", options={
        "attention": {"qk_norm": "rmsnorm", "qk_norm_eps": 1e-5}, "ffn": {"n_experts": 6, "top_k": 3}})
    with pytest.raises(ValueError, match="whole projections"):
        to_transformers(per_head, "olmoe")
    with pytest.raises(ValueError, match="qk_norm_scope"):
        models.DecoderLM.from_preset("olmoe-tiny", options={"attention": {"qk_norm": "rmsnorm",
                                                                           "qk_norm_scope": "layer"}})
