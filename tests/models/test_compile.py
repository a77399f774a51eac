"""torch.compile: blocks trace as one graph, and compiled models match eager."""

from __future__ import annotations

import pytest
import torch

import blocks
from models import DecoderLM, EncoderLM, Seq2SeqTransformer
from models.core.stack import new_caches


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("kind", "backend"), [("decoder", name) for name in blocks.names("attention_backend")] + [("encoder", "sdpa")]
)
def test_layers_compile_with_fullgraph(kind, backend):
    layer = blocks.build("layer", kind, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, sublayer="pre_norm",
                         ffn="swiglu", attention_backend=backend).eval()
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 4:] = False
    args = (x, x) if kind == "decoder" else (x,)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    # Flex attention has no backward on CPU, so it is checked for inference only.
    grad = torch.no_grad() if backend == "flex" else torch.enable_grad()
    with grad:
        torch.testing.assert_close(compiled(*args, mask=mask)[0], layer(*args, mask=mask)[0])


@pytest.mark.parametrize("cls", [DecoderLM, EncoderLM, Seq2SeqTransformer])
def test_models_trace_as_one_graph(cls):
    model = cls.from_preset("tiny", vocab_size=60, d_model=16, n_heads=2, d_ff=32, dropout=0.0).eval()
    x = torch.randint(0, 60, (2, 7))
    args = (x, x) if cls is Seq2SeqTransformer else (x,)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args).logits, model(*args).logits)


@pytest.mark.parametrize(
    "compiler", [pytest.param("inductor", marks=pytest.mark.slow), "aot_eager"]
)
def test_compiled_training_step_matches_eager(compiler):
    """Loss and gradients of a compiled step equal eager ones. Inductor's C++ code generation takes about a
    minute on 2 cores, so CI runs the ``aot_eager`` compiler (the same traced forward and backward graphs)."""
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=60, d_model=16, n_heads=2, d_ff=32, dropout=0.0, n_layers=1)
    x = torch.randint(0, 60, (2, 8))
    eager = model(x, labels=x).loss
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend=compiler)(x, labels=x).loss
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_compiled_cached_decoding_matches_eager():
    model = DecoderLM.from_preset("tiny", vocab_size=60, d_model=16, n_heads=2, d_ff=32, dropout=0.0).eval()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randint(0, 60, (1, 5))
    full = model(x).logits
    cache = new_caches(len(model.layers), max_len=8)
    with torch.no_grad():
        steps = [compiled(x[:, :3], cache=cache).logits] + [compiled(x[:, i:i + 1], cache=cache).logits
                                                            for i in range(3, 5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
