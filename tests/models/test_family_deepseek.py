"""DeepSeek-V2 and DeepSeek-V3 checkpoints against ``transformers`` (logits, greedy generation, export)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from models.convert.export import NotExportable
from tests.models.family_harness import assert_logits_close, build_hf, check_decoder_family, from_live, left_padded

VOCAB = 251  # odd, prime

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py
# Non-default sizes: 9 experts in 3 groups, top-3, a dense first layer wider than the experts, d_value != d_nope.
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, moe_intermediate_size=20, num_hidden_layers=3,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_routed_experts=9,
            num_experts_per_tok=3, n_group=3, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
            kv_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=14)


def deepseek_v3(**overrides: object) -> torch.nn.Module:
    hf = build_hf("DeepseekV3Config", "DeepseekV3ForCausalLM", **{
        **BASE, "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 28, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, **overrides})
    with torch.no_grad():  # a buffer, which build_hf leaves at 0: large enough to steer the choice of experts
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    return hf


def test_deepseek_v3(tmp_path: Path) -> None:
    zoo = check_decoder_family(deepseek_v3(), tmp_path, VOCAB)
    dense, moe = zoo.layers[0].ffn, zoo.layers[1].ffn
    assert dense.router is None and dense.shared_expert.up_proj.weight.shape == (40, 48)
    assert (moe.n_experts, moe.top_k, moe.router_name, moe.n_group, moe.topk_group) == (9, 3, "sigmoid_group", 3, 2)
    assert moe.shared_expert.up_proj.weight.shape == (40, 48)  # 2 shared experts of 20
    assert bool(moe.e_score_correction_bias.abs().gt(0).all())
    assert zoo.config.positional == "rotary_interleaved" and zoo.layers[0].self_attn.q_lora_rank == 28


def test_deepseek_v2_lite_layout_with_yarn(tmp_path: Path) -> None:
    # V2-Lite: no query compression, greedy softmax routing; here with YaRN (mscale_all_dim scales the scores).
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    hf = build_hf("DeepseekV2Config", "DeepseekV2ForCausalLM", **BASE, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5, rope_parameters=rope)
    zoo = check_decoder_family(hf, tmp_path, VOCAB)
    attention = zoo.layers[0].self_attn
    assert attention.q_lora_rank is None and hasattr(attention, "q_proj")
    assert math.isclose(attention.scale, 16 ** -0.5 * (0.1 * 0.707 * math.log(4.0) + 1) ** 2)
    assert zoo.layers[1].ffn.router_name == "softmax" and not zoo.layers[1].ffn.renormalize


@torch.no_grad()
def test_deepseek_v2_group_limited_greedy_from_a_live_state_dict() -> None:
    hf = build_hf("DeepseekV2Config", "DeepseekV2ForCausalLM", **{**BASE, "first_k_dense_replace": 0},
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, topk_method="group_limited_greedy",
                  routed_scaling_factor=1.5)
    zoo, converted = from_live(hf)  # fused experts of a live model
    assert converted.config.options["ffn"]["router"] == "softmax_group" and not converted.config.layer_options
    ids, mask = left_padded(VOCAB, 16)
    assert_logits_close(hf(input_ids=ids, attention_mask=mask).logits, zoo(ids, attention_mask=mask.bool()).logits,
                        mask)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_presets_export_to_their_family_and_back(family: str) -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset(f"{family}-tiny").eval()
    config, state = to_transformers(model, family)
    back = from_transformers(config, state)
    assert back.config.replace(options={}) == model.config.replace(options={})
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_published_presets_have_their_published_shapes() -> None:
    lite = models.DecoderLM.config_class(**models.DecoderLM.presets["deepseek-v2-lite"])
    v3 = models.DecoderLM.config_class(**models.DecoderLM.presets["deepseek-v3"])
    assert (lite.n_layers, lite.block_options("ffn", 1)["n_experts"], lite.block_options("ffn", 0)["n_experts"]) == (
        27, 64, 0)
    assert (v3.n_layers, v3.block_options("ffn", 3)["n_experts"], v3.block_options("ffn", 2)["d_shared"]) == (
        61, 256, 18432)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("topk_method", "noaux_tc", "topk_method"),
    ("n_group", 4, "n_group=4"),
    ("topk_group", 4, "topk_group=4"),
    ("kv_lora_rank", 64, "kv_lora_rank=64"),
    ("first_k_dense_replace", 1.5, "first_k_dense_replace"),
])
def test_unsupported_checkpoints_are_refused_by_name(field: str, value: object, named: str) -> None:
    hf = build_hf("DeepseekV2Config", "DeepseekV2ForCausalLM", **BASE, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=None, topk_method="group_limited_greedy")
    with pytest.raises(ValueError, match=named):
        from_transformers({**hf.config.to_dict(), field: value}, hf.state_dict())


def test_a_v3_router_does_not_export_as_v2() -> None:
    model = models.DecoderLM.from_preset("deepseek_v3-tiny")
    with pytest.raises(NotExportable, match="router='sigmoid_group'"):
        to_transformers(model, "deepseek_v2")


@torch.no_grad()
def test_the_loss_equals_transformers_which_adds_no_router_loss() -> None:
    hf = deepseek_v3(output_router_logits=True, router_aux_loss_coef=0.05)
    zoo, converted = from_live(hf)
    assert converted.config.options["ffn"]["aux_loss_coef"] == 0.0
    ids, _ = left_padded(VOCAB, 12)
    torch.testing.assert_close(zoo(ids, labels=ids).loss, hf(input_ids=ids, labels=ids).loss, atol=1e-5, rtol=0)
    with pytest.raises(NotExportable, match="router loss"):
        to_transformers(models.DecoderLM(converted.config.replace(options={
            **converted.config.options, "ffn": {**converted.config.options["ffn"], "aux_loss_coef": 0.01}})),
            "deepseek_v3")


@pytest.mark.parametrize(("config_class", "task"), [
    ("DeepseekV2Config", "DeepseekV2ForSequenceClassification"),
    ("DeepseekV3Config", "DeepseekV3ForTokenClassification"),
])
@torch.no_grad()
def test_task_classes_convert_with_their_head(config_class: str, task: str, tmp_path: Path) -> None:
    hf = build_hf(config_class, task, **BASE, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                  num_labels=3)
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf").eval()
    assert zoo.config.attention == "mla" and zoo.config.head != "lm"
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(zoo(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)
