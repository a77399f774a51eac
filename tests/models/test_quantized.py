"""int8 weight-only quantization: the layer vs its formula, logits of every family, perplexity of a trained model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import blocks
from blocks.quantized import Int8Linear, quantize_linears
from models import (
    DecoderLM,
    DecoderLMConfig,
    EncoderLM,
    EncoderLMConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    VisionTransformer,
    VisionTransformerConfig,
    auto,
)
from tests.models.test_kv_cache import build

SMALL = dict(vocab_size=64, d_model=32, n_heads=4, d_ff=64, max_len=64, dropout=0.0)


def test_int8_linear_matches_its_formula_and_stores_one_byte_per_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 24)
    q = blocks.get("quantization", "int8").from_linear(linear)
    assert q.weight_int8.dtype == torch.int8 and q.weight_int8.shape == (24, 48)
    # Symmetric per-output-channel over torchao's int8 range [-128, 127]: scale = max|w| / 127.5, so the largest
    # |weight| of each row maps to 127 or -128.
    assert torch.allclose(q.scale, linear.weight.abs().amax(1) / 127.5)
    assert q.weight_int8.int().abs().amax(1).ge(127).all()
    # Round to nearest: every weight within half a step of its int8 value.
    assert ((q.dequantized_weight() - linear.weight).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(3, 5, 48)
    reference = nn.functional.linear(x, q.dequantized_weight(), linear.bias)  # independent: float matmul
    assert torch.allclose(q(x), reference, atol=1e-5)  # several rows: a float copy of the weight and BLAS
    assert torch.allclose(q(x[0, :1]), reference[0, :1], atol=1e-5)  # one row (the int8 kernel on GPU)
    # Compiled without gradients (the fused forms used for decoding steps) gives the same numbers.
    compiled = torch.compile(q, fullgraph=True, dynamic=False)
    with torch.no_grad():
        assert torch.allclose(compiled(x[:, :1]), reference[:, :1], atol=1e-5)
        assert torch.allclose(compiled(x[:1, :1]), reference[:1, :1], atol=1e-5)


def test_quantize_replaces_every_linear_and_rejects_bad_schemes() -> None:
    model = build(DecoderLM, DecoderLMConfig(**SMALL, n_layers=2), 0)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert model.quantize("int8") is model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == n_linear
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'; expected one of \\[.*'int4', 'int8'"):
        model.quantize("int3")
    with pytest.raises(ValueError, match="pass the module that holds the nn.Linear"):
        quantize_linears(nn.Linear(2, 2))


def test_every_architecture_has_quantize_and_dequantize() -> None:
    for name in auto.architectures():
        cls = auto.get_architecture(name)
        assert callable(getattr(cls, "quantize", None)) and callable(getattr(cls, "dequantize", None)), name


@pytest.mark.parametrize("family", ["decoder", "encoder", "seq2seq", "vision"])
def test_logits_of_every_family_stay_close(family: str) -> None:
    # Measured on these models at their own init: relative RMS error of the logits 0.005 (decoder), 0.008
    # (encoder), 0.009 (seq2seq); max |difference| / std(logits) 0.020, 0.025, 0.034. Bounds: 0.015 and 0.05.
    torch.manual_seed(0)
    ids = torch.randint(4, 64, (2, 12))
    if family == "decoder":
        model = build(DecoderLM, DecoderLMConfig(**SMALL, n_layers=2), 0)
        run = lambda m: m(ids).logits  # noqa: E731
    elif family == "encoder":
        model = build(EncoderLM, EncoderLMConfig(**SMALL, n_layers=2), 0)
        run = lambda m: m(ids).logits  # noqa: E731
    elif family == "seq2seq":
        model = build(Seq2SeqTransformer, Seq2SeqConfig(**SMALL, n_encoder_layers=1, n_decoder_layers=1), 0)
        run = lambda m: m(ids, ids[:, :7]).logits  # noqa: E731
    else:
        model = build(VisionTransformer, VisionTransformerConfig(
            image_size=16, patch_size=4, num_channels=3, d_model=32, n_heads=4, d_ff=64, n_layers=2, num_labels=10,
            dropout=0.0), 0)
        pixels = torch.randn(2, 3, 16, 16)
        run = lambda m: m(pixels).logits  # noqa: E731
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    with torch.no_grad():
        before = run(model)
        after = run(model.quantize("int8"))
    assert n_linear and sum(isinstance(m, Int8Linear) for m in model.modules()) == n_linear
    assert (after - before).norm() / before.norm() <= 0.015
    assert (after - before).abs().max() / before.std() <= 0.05
    assert (after - before).abs().max() > 0  # the weights really changed


def test_perplexity_of_a_trained_model_changes_by_less_than_one_percent() -> None:
    # A byte-level model trained for a few seconds on repeated English text learns it well below uniform
    # perplexity (256); int8 weights must keep the perplexity within 1 % (measured 10.170 -> 10.171, +0.008 %).
    text = (
        "Decoding is what users wait on. Reading the weights once per token bounds its speed, so weights "
        "stored at one byte each make every step cheaper while the model predicts almost the same tokens. "
    ) * 4
    data = torch.tensor(list(text.encode()))
    config = DecoderLMConfig(vocab_size=256, d_model=48, n_heads=4, d_ff=96, n_layers=2, max_len=64, dropout=0.0)
    model = build(DecoderLM, config, 0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        starts = torch.randint(0, len(data) - 64, (8,), generator=g)
        batch = torch.stack([data[s : s + 64] for s in starts])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    held_out = torch.stack([data[s : s + 64] for s in range(0, len(data) - 64, 64)])
    with torch.no_grad():
        fp32 = math.exp(model(held_out, labels=held_out).loss.item())
        int8 = math.exp(model.quantize("int8")(held_out, labels=held_out).loss.item())
    assert fp32 < 20  # trained: far below the uniform 256
    assert abs(int8 - fp32) / fp32 <= 0.01


def test_quantized_decoder_generates() -> None:
    model = build(DecoderLM, DecoderLMConfig(**SMALL, n_layers=2), 0)
    prompt = torch.randint(4, 64, (2, 5))
    reference = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    out = model.quantize("int8").generate(prompt, max_new_tokens=6, eos_token_id=None)
    assert out.shape == reference.shape
    assert (out[:, 5:] == reference[:, 5:]).float().mean() > 0.5  # mostly the same greedy tokens
