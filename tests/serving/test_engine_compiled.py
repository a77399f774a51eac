"""``Engine(compile=True)``: decode-only steps run one compiled graph per bucket of rows and blocks (compiled with
``aot_eager`` here, as the generation tests do, to skip inductor's C++ build) and give the eager tokens."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from models.generation import compiled
from serving import Engine
from serving.runner import bucket

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
    # Contexts of up to 53 positions in blocks of 4: block buckets 4, 8 and 16 — one graph each, reused.
    assert counters["stats"]["unique_graphs"] == len(step.compiled) <= 3 < len(calls)
    assert engine.allocator.num_free == engine.allocator.n_blocks
