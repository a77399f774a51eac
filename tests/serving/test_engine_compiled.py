"""``Engine(compile=True)``: decode-only steps run one compiled graph with dynamic shapes (compiled with ``aot_eager``
here, as the generation tests do, to skip inductor's C++ build) and give the eager tokens;
``Engine(compile="attention")``: one compiled graph of the one-token rows' attention (inductor's code checked
once)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import blocks
from blocks.paged_cache import PagedBatch
from models.generation import compiled
from serving import Engine
from serving.runner import DynamicStep, RaggedAttention
from serving.single_row import SingleRowStep

from .test_engine import MAX_TOKENS, alone, prompts, run_staggered, tiny_model

ARRIVALS = {0: [(3, 0), (0, 0)], 2: [(1, 0)], 5: [(4, 0)]}


def staggered(engine: Engine, model, ps):  # noqa: ANN001, ANN201
    """Prompts 3 and 0 at step 0, 1 at step 2, 4 at step 5; each output checked against the request alone."""
    arrivals = {step: [(ps[i], dict(max_tokens=MAX_TOKENS[i])) for i, _ in items] for step, items in ARRIVALS.items()}
    outputs = run_staggered(engine, arrivals)
    for i, out in zip([3, 0, 1, 4], outputs, strict=True):
        assert out.token_ids == alone(model, ps[i], MAX_TOKENS[i])


@pytest.mark.parametrize("preset", ["gemma2-tiny"])  # GQA, soft-caps, alternating windows (sinks: below)
def test_compiled_decode_steps_give_the_tokens_of_generate_alone(monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    """Decode-only steps of many row and block counts run through two compiled graphs (one row: the single-row
    step; several) and give each request's tokens alone."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(preset)
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, num_blocks=64, compile=True)
    assert engine.runner.nbytes == 0  # the pools grow with the blocks in use, compiled steps too
    shapes = []
    assert isinstance(engine.runner.step, DynamicStep) and isinstance(engine.runner.single, SingleRowStep)

    def counting(step):  # noqa: ANN001, ANN202
        def counted(*args):  # noqa: ANN002, ANN202
            rows = args[3][0].self_attn.batch.ragged
            shapes.append((args[1].shape[1], rows.block.shape[0], rows.layout.shape[1]))  # rows, entries, widest
            return step(*args)
        return counted

    engine.runner.step, engine.runner.single = counting(engine.runner.step), counting(engine.runner.single)
    staggered(engine, model, prompts())
    assert len({s[0] for s in shapes}) > 2 and len({s[1] for s in shapes}) > 4 and len({s[2] for s in shapes}) > 2
    # The single-row graph, the several-row graph and the attention graph of the eager steps' one-token rows, once
    # per window (gemma2's layers alternate a window of 8 and none).
    assert counters["stats"]["unique_graphs"] <= 4 < len(set(shapes))
    assert 0 < engine.runner.nbytes < 64 * engine.runner.block_nbytes()
    assert engine.allocator.num_free == engine.allocator.n_blocks


@pytest.mark.parametrize("preset", ["gemma2-tiny", "gpt_oss-tiny"])  # windows and soft-caps; sinks
def test_compiled_attention_gives_the_tokens_of_generate_alone(monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    """``compile="attention"``: every step stays eager and attends its one-token rows through one compiled graph
    (``RaggedAttention``), prefill-chunk steps included; the tokens equal the request's alone."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model = tiny_model(preset)
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, num_blocks=64,
                    compile="attention")
    assert engine.runner.step is None
    ragged = engine.runner.caches[0].self_attn.ragged_attention
    assert isinstance(ragged, RaggedAttention)
    shapes = []
    original = ragged.__call__

    def counted(self: RaggedAttention, *args: torch.Tensor) -> torch.Tensor:
        shapes.append((args[2].shape[0], args[3].block.shape[0]))  # (rows, entries)
        return original(*args)

    monkeypatch.setattr(RaggedAttention, "__call__", counted)
    staggered(engine, model, prompts())
    assert len({rows for rows, _ in shapes}) > 1 and len({e for _, e in shapes}) > 1
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_ragged_attention_compiles_one_graph_for_batches_of_any_size() -> None:
    """Inductor's code for ``ragged_decode_attention`` with dynamic row, entry and width counts equals the gather +
    backend path, and batches of other sizes reuse its graph (GQA, a soft-cap, a window, sinks)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    bs, n_kv, n_heads = 4, 2, 4
    cache = blocks.PagedKVCache(32, bs)
    cache.k, cache.v = torch.randn(n_kv, 32, bs, 8), torch.randn(n_kv, 32, bs, 8)
    batches = [
        [(1, 13, [3, 0, 7, 9]), (1, 6, [5, 11]), (1, 7, [1, 2])],
        [(1, 23, [4, 6, 8, 10, 12, 14]), (1, 18, [13, 15, 16, 17, 18]), (1, 2, [19]), (1, 9, [20, 21, 22]),
         (1, 21, [23, 24, 25, 26, 27, 28])],
        [(1, 9, [3, 0, 7]), (4, 8, [5, 1])],
    ]
    kwargs = dict(scale=0.3, softcap=20.0, window=6, sinks=torch.randn(n_heads))
    ragged = RaggedAttention()
    for rows in batches:
        q = torch.randn(1, n_heads, sum(n for n, _, _ in rows), 8)
        cache.batch, cache.ragged_attention = PagedBatch(rows, bs), None
        want = cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs)
        cache.batch, cache.ragged_attention = PagedBatch(rows, bs, decode="ragged"), ragged
        got = cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_must_be_a_known_mode() -> None:
    with pytest.raises(ValueError, match="compile must be one of .*got 'yes'"):
        Engine(tiny_model("llama-tiny"), compile="yes")
    with pytest.raises(ValueError, match="compile must be one of .*got tensor"):  # no element-wise comparison
        Engine(tiny_model("llama-tiny"), compile=torch.tensor([1, 2]))
