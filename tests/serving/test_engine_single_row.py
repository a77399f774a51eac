"""``Engine(compile=True)``: a lone decoding row runs the single-row graph (``serving.single_row``, as
``generate(compile=True)``), several rows the batched graph, and a run of many batch shapes compiles each graph once,
on 2 layers and (slow) on 30, SmolLM2-135M's depth; the pools grow with the blocks in use; tokens and step logits
equal the eager engine's and each request's alone (compiled with dynamo's ``eager`` backend: the graphs are
dynamo's, counted the same, without AOT autograd's or inductor's compile time)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from models import DecoderLM
from models.generation import compiled
from serving import Engine

from .test_engine import alone, run_staggered

#: Prompt lengths and output lengths; a lone request first, then arrivals while others decode.
LENGTHS = [(5, 9), (13, 14), (3, 6), (22, 11), (9, 12)]
ARRIVALS = {0: [0], 12: [1, 2], 15: [3], 20: [4]}


def thin_model(n_layers: int) -> DecoderLM:
    """``n_layers`` layers of width 16 (30: the depth of SmolLM2-135M at a test's size)."""
    torch.manual_seed(0)
    model = DecoderLM.from_preset("qwen3-tiny", n_layers=n_layers, d_model=16, n_heads=2, n_kv_heads=1, d_head=8,
                                  d_ff=32, vocab_size=97).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


# 2 layers in the quick run; 30 (each layer one nested compile region: traced once) in the slow one.
@pytest.fixture(scope="module", params=[2, pytest.param(30, marks=pytest.mark.slow)], ids=lambda n: f"{n}-layers")
def run(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """One staggered run on a compiled engine and on an eager one (logprobs: the step logits' top 5)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "BACKEND", "eager")  # dynamo alone: its graphs counted, no AOT
        torch._dynamo.reset()
        counters.clear()
        model = thin_model(request.param)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n, _ in LENGTHS]
        outputs, engines = {}, {}
        for mode in (False, True):
            engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64,
                            compile=mode)
            arrivals = {step: [(prompts[i], dict(max_tokens=LENGTHS[i][1], logprobs=5)) for i in items]
                        for step, items in ARRIVALS.items()}
            outputs[mode], engines[mode] = run_staggered(engine, arrivals), engine
        yield dict(model=model, prompts=prompts, outputs=outputs, engine=engines[True],
                   graphs=counters["stats"]["unique_graphs"], frames=dict(counters["frames"]))


def test_a_lone_request_decodes_through_the_single_row_graph_with_the_batched_tokens(run: dict[str, Any]) -> None:
    runner = run["engine"].runner
    assert runner.single.calls >= LENGTHS[0][1] - 1  # the lone request's every decode step
    order = [i for step in sorted(ARRIVALS) for i in ARRIVALS[step]]
    for i, got, want in zip(order, run["outputs"][True], run["outputs"][False], strict=True):
        assert got.token_ids == want.token_ids == alone(run["model"], run["prompts"][i], LENGTHS[i][1])
        # The step logits: each chosen token's log-probability and the top 5, against the eager engine's.
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id and list(a.top) == list(b.top)
            torch.testing.assert_close(torch.tensor([a.logprob, *a.top.values()]),
                                       torch.tensor([b.logprob, *b.top.values()]), rtol=0, atol=1e-4)


def test_each_graph_compiles_once_for_every_batch_shape(run: dict[str, Any]) -> None:
    """Single row, several rows and the eager steps' ragged attention: three graphs, no recompile, whatever the
    row, block and pool sizes of the run's steps (on 30 layers in the slow run)."""
    assert run["graphs"] == 3
    assert run["frames"].get("total") == 3


def test_compiled_pools_grow_with_the_blocks_in_use(run: dict[str, Any]) -> None:
    engine = run["engine"]
    runner = engine.runner
    per_block = runner.block_nbytes()
    assert per_block > 0
    held = runner.nbytes // per_block
    assert engine.peak_blocks <= held < engine.allocator.n_blocks  # grown to the peak (doubling), not whole
    assert held <= 2 * engine.peak_blocks
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_the_single_mode_runs_lone_rows_compiled_and_batches_eagerly(run: dict[str, Any]) -> None:
    """``compile="single"`` (the hybrid): the single-row graph for a lone decoding row, every other step eager with
    the compiled ragged attention; the tokens and step logits are the eager engine's."""
    engine = Engine(run["model"], block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64,
                    compile="single")
    arrivals = {step: [(run["prompts"][i], dict(max_tokens=LENGTHS[i][1], logprobs=5)) for i in items]
                for step, items in ARRIVALS.items()}
    outputs = run_staggered(engine, arrivals)
    assert engine.runner.step is None and engine.runner.single.calls >= LENGTHS[0][1] - 1
    for got, want in zip(outputs, run["outputs"][False], strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id and list(a.top) == list(b.top)
            torch.testing.assert_close(torch.tensor([a.logprob, *a.top.values()]),
                                       torch.tensor([b.logprob, *b.top.values()]), rtol=0, atol=1e-4)
