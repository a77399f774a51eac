"""Qwen3-MoE and Qwen2-MoE checkpoints against ``transformers`` (logits, greedy generation, export)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import assert_logits_close, build_hf, check_decoder_family, from_live, left_padded

VOCAB = 251  # odd, prime
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            moe_intermediate_size=24, num_experts=7, num_experts_per_tok=3)


def test_qwen3_moe(tmp_path: Path) -> None:
    hf = build_hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **BASE, head_dim=16, norm_topk_prob=True)
    zoo = check_decoder_family(hf, tmp_path, VOCAB)
    ffn = zoo.layers[0].ffn
    assert (ffn.n_experts, ffn.top_k, ffn.renormalize) == (7, 3, True)
    assert zoo.layers[0].self_attn.q_norm is not None


@torch.no_grad()
def test_qwen3_moe_without_renormalising_the_kept_weights() -> None:
    hf = build_hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **BASE, head_dim=16, norm_topk_prob=False)
    zoo, converted = from_live(hf)  # fused experts of a live model
    assert converted.config.options["ffn"]["renormalize"] is False
    ids, mask = left_padded(VOCAB, 16)
    expected = hf(input_ids=ids, attention_mask=mask).logits
    assert_logits_close(expected, zoo(ids, attention_mask=mask.bool()).logits, mask)


def test_qwen2_moe_shared_expert_with_sigmoid_gate(tmp_path: Path) -> None:
    hf = build_hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **BASE, shared_expert_intermediate_size=20,
                  tie_word_embeddings=True)
    zoo = check_decoder_family(hf, tmp_path, VOCAB, backends=("math",))
    ffn = zoo.layers[0].ffn
    assert ffn.shared_expert.up_proj.weight.shape == (20, 48)
    assert ffn.router.weight.shape == (8, 48)  # 7 experts, then the shared expert's gate
    assert not ffn.renormalize and zoo.layers[0].self_attn.q_proj.bias is not None


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_presets_export_to_their_family_and_back(family: str) -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset(f"{family}-tiny").eval()
    config, state = to_transformers(model, family)
    back = from_transformers(config, state)
    assert back.config.replace(options={}) == model.config.replace(options={})
    assert back.config.options["ffn"] == {"expert": "swiglu", "aux_loss_coef": 0.0, **model.config.options["ffn"]}
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize(("config_class", "task"), [
    ("MixtralConfig", "MixtralForSequenceClassification"), ("Qwen3MoeConfig", "Qwen3MoeForQuestionAnswering"),
    ("Qwen2MoeConfig", "Qwen2MoeForTokenClassification"),
])
@torch.no_grad()
def test_task_classes_convert_with_their_head(config_class: str, task: str, tmp_path: Path) -> None:
    labels = {} if "QuestionAnswering" in task else dict(num_labels=3)
    hf = build_hf(config_class, task, **BASE, num_local_experts=7, shared_expert_intermediate_size=20, **labels)
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf").eval()
    assert zoo.config.ffn == "moe" and zoo.config.head != "lm"
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    expected, actual = hf(input_ids=ids), zoo(ids)
    if hasattr(expected, "start_logits"):
        expected = torch.stack([expected.start_logits, expected.end_logits], -1)
        actual = torch.stack([actual.start_logits, actual.end_logits], -1)
    else:
        expected, actual = expected.logits, actual.logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("config_class", "model_class", "extra"), [
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16, "norm_topk_prob": True}),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"shared_expert_intermediate_size": 32, "decoder_sparse_step": 2}),
])
@torch.no_grad()
def test_dense_layers_among_the_moe_ones_load_as_a_per_layer_ffn(config_class: str, model_class: str,
                                                                 extra: dict, tmp_path: Path) -> None:
    """``mlp_only_layers`` (and ``decoder_sparse_step``): those layers are ``moe`` blocks without routed experts whose
    shared expert is the ``intermediate_size`` MLP, as DeepSeek's first dense layers are; logits equal transformers'."""
    hf = build_hf(config_class, model_class, vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=24, num_experts=4,
                  num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=64, **extra).eval()
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf")
    dense = [i for i in range(4) if zoo.layers[i].ffn.n_experts == 0]
    assert dense == ([0] if "decoder_sparse_step" not in extra else [0, 2])
    assert all(zoo.layers[i].ffn.shared_expert.up_proj.weight.shape == (40, 48) for i in dense)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(zoo(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_mlp_only_layers_that_are_not_layer_indices_are_refused(tmp_path: Path) -> None:
    hf = build_hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", vocab_size=97, hidden_size=48, intermediate_size=40,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    hf.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**raw, "mlp_only_layers": [5]}))
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[5\].*a list of layer indices in \[0, 2\)"):
        models.from_pretrained(tmp_path / "hf")
