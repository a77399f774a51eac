"""Gemma 2 checkpoints against ``transformers`` (logits, generation, export) and by hand for what it adds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, to_transformers
from tests.models.family_harness import build_hf, check_decoder_family

VOCAB = 251  # odd, prime
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0)


def gemma2(**overrides: object) -> torch.nn.Module:
    return build_hf("Gemma2Config", "Gemma2ForCausalLM", **{**BASE, **overrides})


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(tie_word_embeddings=False, attention_bias=True, layer_types=["full_attention", "sliding_attention",
                                                                         "sliding_attention"]),
], ids=["default-layer-types", "untied-bias-layer_types"])
def test_gemma2(overrides: dict, tmp_path: Path) -> None:
    """Small caps (2 and 3) so that both soft-cappings bend the scores; a window of 5 under 24-token sequences."""
    zoo = check_decoder_family(gemma2(**overrides), tmp_path, VOCAB, length=24)
    windows = [layer.self_attn.window for layer in zoo.layers]
    assert windows == ([5, None, 5] if not overrides else [None, 5, 5])
    attn = zoo.layers[0].self_attn
    assert attn.softcap == 2.0 and attn.scale == pytest.approx(20 ** -0.5) and zoo.config.logit_softcap == 3.0


@torch.no_grad()
def test_gemma2_layer_by_hand() -> None:
    """One Gemma 2 layer written out from the paper's description: (1 + w) RMSNorm on both sides of each
    sublayer, GeGLU-tanh, the embedding scale and the final cap, against the zoo model."""
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("gemma2-tiny", vocab_size=97, n_layers=1, layer_options=()).eval()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 97, (1, 7))
    c, layer = model.config, model.layers[0]

    def norm(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * (1 + module.weight)

    def rope(x: torch.Tensor) -> torch.Tensor:  # (H, L, d) half-split rotary, base 10000
        d = x.shape[-1]
        angle = torch.arange(x.shape[1])[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    a = layer.self_attn
    x = model.embed_tokens.weight[ids[0]] * c.d_model ** 0.5
    h = norm(x, layer.self_attn_sublayer.norm)
    q = rope((h @ a.q_proj.weight.T).view(7, 4, 32).transpose(0, 1))
    k = rope((h @ a.k_proj.weight.T).view(7, 2, 32).transpose(0, 1)).repeat_interleave(2, 0)
    v = (h @ a.v_proj.weight.T).view(7, 2, 32).transpose(0, 1).repeat_interleave(2, 0)
    scores = q @ k.transpose(-1, -2) * 32 ** -0.5
    scores = 50.0 * torch.tanh(scores / 50.0) + torch.full((7, 7), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(7, 128) @ a.o_proj.weight.T
    x = x + norm(attn, layer.self_attn_sublayer.post_norm)
    h = norm(x, layer.ffn_sublayer.norm)
    f = layer.ffn
    mlp = (torch.nn.functional.gelu(h @ f.gate_proj.weight.T, approximate="tanh") * (h @ f.up_proj.weight.T))
    x = x + norm(mlp @ f.down_proj.weight.T, layer.ffn_sublayer.post_norm)
    logits = norm(x, model.final_norm) @ model.embed_tokens.weight.T
    expected = 30.0 * torch.tanh(logits / 30.0)
    torch.testing.assert_close(model(ids).logits[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("field", "value"), [
    ("use_bidirectional_attention", True),
    ("hidden_activation", "relu"),
    ("layer_types", ["full_attention", "chunked_attention", "full_attention"]),
    ("final_logit_softcapping", -1.0),
])
def test_unrepresentable_gemma2_fields_are_refused_by_name(field: str, value: object) -> None:
    hf = gemma2()
    config = {**hf.config.to_dict(), field: value}
    with pytest.raises(ValueError, match=field):
        from_transformers(config, hf.state_dict())


def test_gemma2_partial_rotary_is_refused() -> None:
    hf = gemma2()
    config = hf.config.to_dict()
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        from_transformers(config, hf.state_dict())


def test_export_refuses_what_gemma2_cannot_represent() -> None:
    with pytest.raises(ValueError, match="rmsnorm_offset"):
        to_transformers(models.DecoderLM.from_preset("llama-tiny"), "gemma2")
    with pytest.raises(ValueError, match="attention scale"):
        to_transformers(models.DecoderLM.from_preset("gemma2-tiny", options={"attention": {"scale": 0.3}}), "gemma2")
    model = models.DecoderLM.from_preset("gemma2-tiny", layer_options=({"attention": {"window": 8}},
                                                                       {"attention": {"window": 4}}))
    with pytest.raises(ValueError, match="several window sizes"):
        to_transformers(model, "gemma2")


def test_preset_exports_to_gemma2_and_back() -> None:
    torch.manual_seed(0)
    model = models.DecoderLM.from_preset("gemma2-tiny").eval()
    config, state = to_transformers(model, "gemma2")
    back = from_transformers(config, state)
    assert back.config.replace(options={}) == model.config.replace(options={})
    assert back.config.block_options("attention") == model.config.block_options("attention")
    assert back.config.block_options("positional") == {"base": 10000.0}
    reloaded = models.DecoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_gemma_2_2b_preset_shape() -> None:
    """The published Gemma 2 2B: 2.61 B parameters (tied embeddings), sliding windows on even layers."""
    with torch.device("meta"):
        model = models.DecoderLM.from_preset("gemma-2-2b")
    assert sum(p.numel() for p in model.parameters()) == 2_614_341_888
    assert [layer.self_attn.window for layer in model.layers[:3]] == [4096, None, 4096]
