"""Mixtral checkpoints against ``transformers``: logits, greedy generation, export, and the auxiliary loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import build_hf, check_decoder_family, from_live, left_padded

VOCAB = 251  # odd, prime
# 5 experts (not a power of two, not divisible by top_k), top-2, GQA, a window shorter than the sequence.
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            num_local_experts=5, num_experts_per_tok=2, sliding_window=7)


@pytest.fixture(scope="module")
def hf_mixtral() -> torch.nn.Module:
    return build_hf("MixtralConfig", "MixtralForCausalLM", **BASE)


def test_mixtral_against_transformers(hf_mixtral: torch.nn.Module, tmp_path: Path) -> None:
    zoo = check_decoder_family(hf_mixtral, tmp_path, VOCAB)
    ffn = zoo.layers[0].ffn
    assert (ffn.n_experts, ffn.top_k, ffn.renormalize) == (5, 2, True)
    assert zoo.layers[0].self_attn.window == 7


@torch.no_grad()
def test_a_live_state_dict_with_fused_experts_loads(hf_mixtral: torch.nn.Module) -> None:
    """transformers 5 keeps the experts fused in memory (``mlp.experts.gate_up_proj``); that state dict loads too."""
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in hf_mixtral.state_dict())
    zoo, _ = from_live(hf_mixtral)
    ids, mask = left_padded(VOCAB, 10)
    torch.testing.assert_close(zoo(ids).logits, hf_mixtral(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_the_auxiliary_loss_equals_transformers_router_aux_loss_term() -> None:
    """With ``output_router_logits`` transformers adds ``router_aux_loss_coef · load_balancing_loss`` to the LM loss
    (padding left out); the converted model's loss is the same sum, and its gradient reaches the routers."""
    hf = build_hf("MixtralConfig", "MixtralForCausalLM", **BASE, output_router_logits=True, router_aux_loss_coef=0.3)
    zoo, converted = from_live(hf)
    assert converted.config.options["ffn"]["aux_loss_coef"] == 0.3
    ids, mask = left_padded(VOCAB, 12)
    labels = ids.masked_fill(mask == 0, -100)
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
    assert expected.aux_loss > 0
    out = zoo(ids, attention_mask=mask.bool(), labels=labels)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=0)
    plain = models.DecoderLM(converted.config.replace(options={**converted.config.options, "ffn": {
        **converted.config.options["ffn"], "aux_loss_coef": 0.0}})).eval()
    plain.load_state_dict(converted.state_dict)
    lm_only = plain(ids, attention_mask=mask.bool(), labels=labels).loss
    torch.testing.assert_close(out.loss - lm_only, 0.3 * expected.aux_loss, atol=1e-5, rtol=0)
    out.loss.backward()
    assert zoo.layers[0].ffn.router.weight.grad.abs().sum() > 0
    assert all(layer.ffn.router_logits is None for layer in zoo.layers)  # taken by the loss, not kept


def test_preset_exports_to_mixtral_and_back() -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("mixtral-tiny").eval()
    config, state = to_transformers(model, "mixtral")
    assert config["num_local_experts"] == 5 and "model.layers.1.block_sparse_moe.experts.4.w3.weight" in state
    back = from_transformers(config, state)
    assert back.config.replace(options={}) == model.config.replace(options={})
    # The export spells out the block's defaults.
    assert back.config.options["ffn"] == {"renormalize": True, "expert": "swiglu", **model.config.options["ffn"]}
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_export_refuses_what_mixtral_cannot_represent() -> None:
    shared = models.DecoderLM.from_preset("mixtral-tiny", options={"ffn": {"d_shared": 8}})
    with pytest.raises(ValueError, match="shared expert"):
        to_transformers(shared, "mixtral")
    with pytest.raises(ValueError, match="moe"):
        to_transformers(models.DecoderLM.from_preset("mixtral-tiny"), "llama")
    with pytest.raises(ValueError, match="moe"):
        to_transformers(models.DecoderLM.from_preset("llama-tiny"), "mixtral")


def test_more_experts_per_token_than_experts_is_refused_by_name() -> None:
    hf = build_hf("MixtralConfig", "MixtralForCausalLM", **BASE)
    config = {**hf.config.to_dict(), "num_experts_per_tok": 6}
    with pytest.raises(ValueError, match="num_experts_per_tok=6"):
        from_transformers(config, hf.state_dict())
