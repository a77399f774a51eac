"""``Engine(compile=True)``: decode-only steps run one compiled graph per bucket of rows and blocks (compiled with
``aot_eager`` here, as the generation tests do, to skip inductor's C++ build) and give the eager tokens;
``Engine(compile="attention")``: one compiled attention graph with dynamic shapes (inductor's code checked once)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import blocks
from blocks.paged_cache import PagedBatch
from models.generation import compiled
from serving import Engine
from serving.runner import FusedAttention, bucket

from .test_engine import MAX_TOKENS, alone, prompts, run_staggered, tiny_model


def test_bucket_sizes() -> None:
    assert [bucket(n, 8) for n in (1, 8, 9, 33)] == [8, 8, 16, 64]


@pytest.mark.parametrize("preset", ["gemma2-tiny"])  # GQA, soft-caps, a window of 8 on alternate layers
def test_compiled_decode_steps_give_the_tokens_of_generate_alone(monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(preset)
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, num_blocks=64, compile=True)
    calls = []
    step = engine.runner.step

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(args[1].shape)
        return step(*args)

    engine.runner.step = counted
    arrivals = {0: [(ps[3], dict(max_tokens=MAX_TOKENS[3])), (ps[0], dict(max_tokens=MAX_TOKENS[0]))],
                2: [(ps[1], dict(max_tokens=MAX_TOKENS[1]))], 5: [(ps[4], dict(max_tokens=MAX_TOKENS[4]))]}
    outputs = run_staggered(engine, arrivals)
    for i, out in zip([3, 0, 1, 4], outputs, strict=True):
        assert out.token_ids == alone(model, ps[i], MAX_TOKENS[i])
    assert calls and all(shape == (1, 8) for shape in calls)  # decode-only steps, padded to 8 rows
    # Contexts of up to 53 positions in blocks of 4: block buckets 4, 8 and 16 — one graph each, reused; plus the
    # one attention graph of the decoding rows in steps that also hold a prefill chunk (eager steps).
    assert isinstance(engine.runner.caches[0].self_attn.fused_attention, FusedAttention)
    assert counters["stats"]["unique_graphs"] - 1 == len(step.compiled) <= 3 < len(calls)
    assert engine.allocator.num_free == engine.allocator.n_blocks


@pytest.mark.parametrize("preset", ["gemma2-tiny", "gpt_oss-tiny"])  # windows and soft-caps; sinks
def test_compiled_attention_gives_the_tokens_of_generate_alone(monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    """``compile="attention"``: every step stays eager and attends its one-token rows through one compiled graph
    (``FusedAttention``), prefill-chunk steps included; the tokens equal the request's alone."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model = tiny_model(preset)
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, num_blocks=64,
                    compile="attention")
    assert engine.runner.step is None
    fused = engine.runner.caches[0].self_attn.fused_attention
    assert isinstance(fused, FusedAttention)
    shapes = []
    original = fused.__call__

    def counted(self: FusedAttention, *args: torch.Tensor) -> torch.Tensor:
        shapes.append((args[2].shape[0], args[3].shape[2]))  # (rows, blocks) of the group
        return original(*args)

    monkeypatch.setattr(FusedAttention, "__call__", counted)
    arrivals = {0: [(ps[3], dict(max_tokens=MAX_TOKENS[3])), (ps[0], dict(max_tokens=MAX_TOKENS[0]))],
                2: [(ps[1], dict(max_tokens=MAX_TOKENS[1]))], 5: [(ps[4], dict(max_tokens=MAX_TOKENS[4]))]}
    outputs = run_staggered(engine, arrivals)
    for i, out in zip([3, 0, 1, 4], outputs, strict=True):
        assert out.token_ids == alone(model, ps[i], MAX_TOKENS[i])
    # Groups of several rows and of several block counts went through the one compiled function.
    assert len({rows for rows, _ in shapes}) > 1 and len({nb for _, nb in shapes}) > 1
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_fused_attention_compiles_one_graph_for_groups_of_any_size() -> None:
    """Inductor's code for ``fused_group_attention`` with dynamic row and block counts equals the gather +
    backend path, and groups of other sizes reuse its graph (GQA, a soft-cap, a window)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    bs, n_kv, n_heads = 4, 2, 4
    cache = blocks.PagedKVCache(32, bs)
    cache.k, cache.v = torch.randn(n_kv, 32, bs, 8), torch.randn(n_kv, 32, bs, 8)
    fused = FusedAttention()
    groups = [
        [(1, 13, [3, 0, 7, 9]), (1, 6, [5, 11]), (1, 7, [1, 2])],
        [(1, 23, [4, 6, 8, 10, 12, 14]), (1, 18, [13, 15, 16, 17, 18]), (1, 2, [19]), (1, 9, [20, 21, 22]),
         (1, 21, [23, 24, 25, 26, 27, 28])],
        [(1, 9, [3, 0, 7]), (1, 5, [5, 1])],
    ]
    for rows in groups:
        cache.batch = PagedBatch(rows, bs)
        q = torch.randn(1, n_heads, len(rows), 8)
        kwargs = dict(scale=0.3, softcap=20.0, window=6)
        cache.fused_attention = None
        want = cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs)
        cache.fused_attention = fused
        got = cache.attend(q, blocks.get("attention_backend", "sdpa"), **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_must_be_a_known_mode() -> None:
    with pytest.raises(ValueError, match="compile must be one of .*got 'yes'"):
        Engine(tiny_model("llama-tiny"), compile="yes")
