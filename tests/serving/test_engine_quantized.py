"""Quantized models run wherever a model runs: the engine (eager and ``compile=True``, continuous batching, prefix
caching), compiled ``generate`` and speculative decoding give the tokens (and step logits) of eager ``generate`` on
the same quantized model. The model quantizes every linear layer as int8 and packs its token embedding too, its
tied head being the embedding's packed table (as a GGUF file loads), so nothing of it reads a float weight."""

from __future__ import annotations

import copy

import pytest
import torch

import blocks
from blocks.quantized import Int8Linear, QuantizedEmbedding, QuantizedLinear
from models import DecoderLM
from models.generation import compiled
from models.generation.speculative import speculative_decode
from serving import Engine
from serving.engine import kv_block_nbytes
from serving.engine_process import ModelSource
from serving.runner import float_like

from .test_engine import MAX_TOKENS, alone, prompts, run_staggered, tiny_model

ARRIVALS = {0: [(3, 0), (0, 0)], 2: [(1, 0)], 5: [(4, 0), (2, 0)]}


def quantize_tied(model: DecoderLM, scheme: str = "int8", **options: object) -> DecoderLM:
    """``model`` (with a tied head) quantized with ``scheme`` (and its ``options``) in place, its token embedding
    packed as well: the head and the embedding are one packed table (``QuantizedEmbedding(lm_head)``), as a GGUF
    file loads them."""
    if not model.config.tie_embeddings:
        raise ValueError("quantize_tied needs a model whose head is tied to its embedding")
    model.quantize(scheme, **options)
    model.embed_tokens = QuantizedEmbedding(model.lm_head)
    assert model.embed_tokens.table is model.lm_head and isinstance(model.lm_head, QuantizedLinear)
    return model


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    """A GPT-2-like tiny model (learned positions, tied head), int8 everywhere with a packed embedding."""
    quantized = quantize_tied(tiny_model("tiny"))
    assert not any(p.dtype == torch.int8 for p in quantized.parameters())
    assert {b.dtype for b in quantized.buffers()} >= {torch.int8}
    return quantized


def staggered(engine: Engine, model: DecoderLM, ps: list[list[int]]) -> None:
    """Prompts 3 and 0 at step 0, 1 at step 2, 4 and 2 at step 5 (prefill chunks beside decode rows); each output
    checked against ``generate`` on the request alone."""
    arrivals = {step: [(ps[i], dict(max_tokens=MAX_TOKENS[i])) for i, _ in items] for step, items in ARRIVALS.items()}
    outputs = run_staggered(engine, arrivals)
    distinct = set()
    for i, out in zip([3, 0, 1, 4, 2], outputs, strict=True):
        assert out.token_ids == alone(model, ps[i], MAX_TOKENS[i]), i
        distinct |= set(out.token_ids)
    assert len(distinct) > 10  # not one repeated token
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_float_dtype_and_block_bytes_come_from_float_parameters(model: DecoderLM) -> None:
    like = float_like(model)
    assert like.dtype == torch.float32 and like.numel() == 0
    assert model.embed_tokens.weight.dtype == torch.int8  # what the engine read its dtype from before
    # Keys and values of 2 layers, 4 heads of 16, 4 positions, 4 bytes each: as the float model's.
    assert kv_block_nbytes(model, 4) == kv_block_nbytes(tiny_model("tiny"), 4) == 2 * 2 * 4 * 16 * 4 * 4
    with pytest.raises(ValueError, match="no floating parameter"):
        float_like(torch.nn.Module())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_continuous_batch_of_a_quantized_model_gives_generate_alone(model: DecoderLM, scheme: str) -> None:
    if scheme not in blocks.names("quantization"):
        pytest.skip(f"no {scheme!r} scheme registered")
    if scheme != "int8":  # a second scheme (group-wise, with zero points), groups of 32 for d_model = 64
        model = quantize_tied(tiny_model("tiny"), scheme, group_size=32)
        assert model.lm_head.scheme == scheme
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    staggered(engine, model, prompts())


def test_prefix_cache_hit_on_a_quantized_model_gives_the_tokens_of_a_miss(model: DecoderLM) -> None:
    shared = prompts(3)[4][:22]
    tails = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    engine = Engine(model, block_size=4, max_num_batched_tokens=64)
    first = engine.generate([shared + tails[0]], max_tokens=10)[0]
    second = engine.generate([shared + tails[1], shared + tails[0]], max_tokens=10)
    assert engine.scheduler.prefix_hits == 20 + 24  # 5 shared blocks; the repeat's whole prompt but its last block
    assert second[1].token_ids == first.token_ids == alone(model, shared + tails[0], 10)
    assert second[0].token_ids == alone(model, shared + tails[1], 10)


def test_compiled_engine_steps_of_a_quantized_model_give_generate_alone(
    monkeypatch: pytest.MonkeyPatch, model: DecoderLM
) -> None:
    """``compile=True`` grows the pools in the model's float dtype, not its packed embedding's int8. Two
    prompts of other lengths (so other block counts) decode together through the compiled step (one graph: the
    continuous batch of the eager engine is tested above; each further graph costs seconds)."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # the graph dynamo captures, without inductor's C++ build
    torch._dynamo.reset()
    engine = Engine(model, block_size=4, max_num_seqs=2, num_blocks=64, compile=True)
    calls = []
    step = engine.runner.step
    engine.runner.step = lambda *args: calls.append(1) or step(*args)
    ps = prompts()
    outputs = engine.generate([ps[3], ps[1]], max_tokens=12)
    for prompt, out in zip([ps[3], ps[1]], outputs, strict=True):
        assert out.token_ids == alone(model, prompt, 12)
    assert len(calls) >= 10  # the decode-only steps ran the compiled graph
    assert engine.allocator.num_free == engine.allocator.n_blocks
    pool = engine.runner.caches[0].self_attn
    assert pool.k.dtype == pool.v.dtype == torch.float32


def test_compiled_generate_gives_the_eager_step_logits(monkeypatch: pytest.MonkeyPatch, model: DecoderLM) -> None:
    """Each compiled step's logits (the packed weights unpacked inside the graph) equal one eager forward pass over
    the whole generated sequence (the packed weights multiplied by BLAS, no cache)."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    made, logits = compiled.compile_step, []

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        run = made(*args, **kwargs)
        return lambda *a, **k: logits.append(run(*a, **k).clone()) or logits[-1]

    monkeypatch.setattr(compiled, "compile_step", recording)
    prompt = torch.randint(3, 1000, (2, 9), generator=torch.Generator().manual_seed(4))
    out = model.generate(prompt, max_new_tokens=12, eos_token_id=None, compile=True)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=12, eos_token_id=None))
    steps = torch.stack(logits, 1)  # (2, n, V): the logits after new tokens 1 .. n
    assert steps.shape[:2] == (2, 11)
    with torch.no_grad():
        full = model(out).logits[:, 9 : 9 + steps.shape[1]]
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-4)


def test_speculative_decoding_with_quantized_target_and_draft_gives_plain_greedy(model: DecoderLM) -> None:
    prompt = torch.tensor([prompts(5)[1]])
    float_target = tiny_model("tiny")
    plain = float_target.generate(prompt, max_new_tokens=20, eos_token_id=None)
    # A float target with its own int8 copy as the draft: the draft mostly agrees.
    out = speculative_decode(float_target, model, prompt, max_new_tokens=20, num_draft_tokens=3, eos_token_id=None)
    assert torch.equal(out.sequences, plain) and out.accepted > 0
    # A quantized target with a float draft of one layer, then with a quantized draft (compiled).
    torch.manual_seed(1)
    draft = DecoderLM.from_preset("tiny", dropout=0.0, n_layers=1).eval()
    quantized_plain = model.generate(prompt, max_new_tokens=20, eos_token_id=None)
    got = model.generate(prompt, max_new_tokens=20, eos_token_id=None, draft_model=draft, num_draft_tokens=4)
    assert torch.equal(got, quantized_plain)
    quantized_draft = quantize_tied(copy.deepcopy(draft))
    assert isinstance(quantized_draft.layers[0].ffn.up_proj, Int8Linear)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "BACKEND", "aot_eager")
        torch._dynamo.reset()
        fast = speculative_decode(model, quantized_draft, prompt, max_new_tokens=20, num_draft_tokens=4,
                                  eos_token_id=None, compile=True)
    assert torch.equal(fast.sequences, quantized_plain) and fast.proposed > 0


def test_model_source_rebuilds_a_quantized_model_packed() -> None:
    """What an engine process builds from ``ModelSource.from_model`` (called here, without a process): the packed
    layers and tensors, the head still the embedding's table, and the same logits."""
    model = quantize_tied(tiny_model("tiny"))
    if "int4" in blocks.names("quantization"):  # a scheme with options too: config.json-like round trip
        model.layers[1].ffn.up_proj = blocks.get("quantization", "int4").from_linear(
            tiny_model("tiny").layers[1].ffn.up_proj, group_size=32)
    rebuilt = ModelSource.from_model(model).build()
    assert rebuilt.embed_tokens.table is rebuilt.lm_head and isinstance(rebuilt.lm_head, Int8Linear)
    state, again = model.state_dict(), rebuilt.state_dict()
    assert state.keys() == again.keys() and all(torch.equal(state[k], again[k]) for k in state)
    assert type(rebuilt.layers[1].ffn.up_proj) is type(model.layers[1].ffn.up_proj)
    x = torch.tensor([prompts()[1]])
    with torch.no_grad():
        assert torch.equal(rebuilt(x).logits, model(x).logits)
