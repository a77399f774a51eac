"""gpt-oss checkpoints against ``transformers``: logits (sinks, alternating windows, YaRN, biased router, clamped
experts), greedy generation, compiled decoding, export, and the auxiliary loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import build_hf, check_decoder_family, from_live, left_padded

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py

VOCAB = 251  # odd, prime
# 5 experts, top-2, GQA, head_dim != hidden / heads, a window (7) shorter than the sequences, 3 layers
# (sliding, full, sliding), YaRN at a non-default factor.
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=20, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, num_local_experts=5, num_experts_per_tok=2, sliding_window=7,
            rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64, "rope_theta": 150000.0})


def gpt_oss(**config: object) -> torch.nn.Module:
    hf = build_hf("GptOssConfig", "GptOssForCausalLM", **{**BASE, **config})
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # sinks large enough to matter (a head may attend mostly to its sink)
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen) * 2)
    return hf


@pytest.fixture(scope="module")
def hf_gpt_oss() -> torch.nn.Module:
    return gpt_oss()


def test_gpt_oss_against_transformers(hf_gpt_oss: torch.nn.Module, tmp_path: Path) -> None:
    zoo = check_decoder_family(hf_gpt_oss, tmp_path, VOCAB)
    windows = [layer.self_attn.window for layer in zoo.layers]
    assert windows == [7, None, 7]
    attn, ffn = zoo.layers[0].self_attn, zoo.layers[0].ffn
    assert attn.sinks.shape == (6,) and attn.q_proj.bias is not None and attn.o_proj.bias is not None
    assert ffn.router.bias is not None and type(ffn.experts[0]).__name__ == "ClampedSwiGLUFFN"
    assert zoo.config.block_options("positional")["scaling"]["type"] == "yarn"


@torch.no_grad()
def test_the_chunked_backend(hf_gpt_oss: torch.nn.Module) -> None:
    """(flex is checked with sinks, windows and a cache at the block level: tests/blocks/test_attention_sinks.py.)"""
    zoo, _ = from_live(hf_gpt_oss)
    zoo.set_attention_backend("chunked")
    ids, mask = left_padded(VOCAB, 16)
    expected = hf_gpt_oss(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(zoo(ids, attention_mask=mask.bool()).logits[mask.bool()], expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_compiled_decoding_with_sinks_and_a_window_gives_the_eager_tokens(graph_backend: None) -> None:
    """One sliding-window layer with sinks (a dense FFN: the MoE block's compiled path is tested in
    test_moe_decoding.py), left-padded batch."""
    options = {k: v for k, v in models.DecoderLM.presets["gpt_oss-tiny"]["options"].items() if k != "ffn"}
    torch.manual_seed(0)
    zoo = models.DecoderLM.from_preset("gpt_oss-tiny", vocab_size=64, ffn="swiglu", options=options, n_layers=1,
                                       layer_options=({"attention": {"window": 4}},)).eval()
    zoo.layers[0].self_attn.sinks.normal_(0, 2)
    ids, mask = left_padded(64, 6, pad=2)
    greedy = dict(attention_mask=mask.bool(), max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert torch.equal(zoo.generate(ids, compile=True, **greedy), zoo.generate(ids, **greedy))
    torch._dynamo.reset()


def test_the_auxiliary_loss_equals_transformers_router_aux_loss_term() -> None:
    hf = gpt_oss(output_router_logits=True, router_aux_loss_coef=0.3)
    zoo, converted = from_live(hf)
    assert converted.config.options["ffn"]["aux_loss_coef"] == 0.3
    ids, mask = left_padded(VOCAB, 12)
    labels = ids.masked_fill(mask == 0, -100)
    expected = hf(input_ids=ids, attention_mask=mask, labels=labels)
    assert expected.aux_loss > 0
    out = zoo(ids, attention_mask=mask.bool(), labels=labels)
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=0)
    out.loss.backward()
    assert zoo.layers[0].ffn.router.bias.grad.abs().sum() > 0 and zoo.layers[0].self_attn.sinks.grad.abs().sum() > 0


def test_preset_exports_to_gpt_oss_and_back() -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("gpt_oss-tiny").eval()
    config, state = to_transformers(model, "gpt_oss")
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 8
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (5, 64, 64)
    back = from_transformers(config, state)
    assert back.config.replace(options={}) == model.config.replace(options={})
    assert back.config.options == {**model.config.options, "ffn": {**model.config.options["ffn"], "aux_loss_coef": 0.0}}
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_what_gpt_oss_cannot_represent_is_refused_by_name(hf_gpt_oss: torch.nn.Module) -> None:
    config, state = hf_gpt_oss.config.to_dict(), hf_gpt_oss.state_dict()
    with pytest.raises(ValueError, match="swiglu_limit=5.0"):
        from_transformers({**config, "swiglu_limit": 5.0}, state)
    blocks = {"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1), **state}
    with pytest.raises(ValueError, match="MXFP4"):
        from_transformers(config, blocks)
    no_sinks = models.DecoderLM.from_preset("gpt_oss-tiny", options={
        **models.DecoderLM.presets["gpt_oss-tiny"]["options"], "attention": {}})
    with pytest.raises(ValueError, match="sinks"):
        to_transformers(no_sinks, "gpt_oss")
    with pytest.raises(ValueError, match="sinks"):  # a family without sinks refuses them
        to_transformers(models.DecoderLM.from_preset("llama-tiny", options={"attention": {"sinks": True}}), "llama")


@pytest.mark.parametrize("task", ["GptOssForSequenceClassification", "GptOssForTokenClassification"])
@torch.no_grad()
def test_task_classes_convert_with_their_head(task: str, tmp_path: Path) -> None:
    hf = build_hf("GptOssConfig", task, **BASE, num_labels=3)
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf").eval()
    assert zoo.config.ffn == "moe" and zoo.config.head != "lm"
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(zoo(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("preset", "what"), [("gpt_oss-tiny", "sinks"), ("olmoe-tiny", "qk_norm_scope='projection'")])
def test_tensor_parallel_plans_refuse_whole_head_tensors_by_name(preset: str, what: str) -> None:
    from blocks.parallel import tensor_parallel_plan

    with pytest.raises(ValueError, match=f"layers.0.self_attn has {what}"):
        tensor_parallel_plan(models.DecoderLM.from_preset(preset), 2)


@torch.no_grad()
def test_speculative_decoding_and_lora_on_the_expert_linears() -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("gpt_oss-tiny", vocab_size=64).eval()
    for layer in model.layers:
        layer.self_attn.sinks.normal_(0, 2)
    draft = models.DecoderLM(model.config).eval()
    draft.load_state_dict(model.state_dict())
    prompt = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=8, eos_token_id=None)
    plain = model.generate(prompt, **greedy)
    assert torch.equal(model.generate(prompt, draft_model=draft, num_draft_tokens=3, **greedy), plain)
    targets = model.add_adapter(kind="lora", r=2, alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    assert "layers.1.ffn.experts.4.down_proj" in targets
    base = model(prompt).logits
    for name, p in model.named_parameters():
        if "lora" in name:
            p.normal_(0, 0.1)
    adapted = model(prompt).logits
    assert not torch.allclose(adapted, base, atol=1e-4)
    torch.testing.assert_close(model.merge_and_unload()(prompt).logits, adapted, atol=1e-5, rtol=0)
