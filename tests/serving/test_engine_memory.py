"""What the engine process holds: loading a checkpoint adds no copy of the weights to its heap (the weights stay
mapped from the file), freed heap goes back to the system, the KV pools track the blocks in use, and the memory
figures read from ``/proc`` add up."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from models import DecoderLM
from models.generation import compiled
from serving import Engine
from serving.memory import (
    compiled_graph_count,
    descendants,
    heap_breakdown,
    process_memory,
    release_compile_state,
    release_freed_memory,
    tree_memory,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/PID/smaps_rollup is Linux's")

_PROBE = """
import gc, json, sys
from models import DecoderLM
from serving.memory import process_memory, release_freed_memory
DecoderLM.from_pretrained(sys.argv[2])  # the imports and caches a first load makes, on a tiny checkpoint
gc.collect(); release_freed_memory()
before = process_memory()["anonymous"]
model = DecoderLM.from_pretrained(sys.argv[1])
gc.collect()
print(json.dumps({"grown": process_memory()["anonymous"] - before,
                  "weights": sum(p.nbytes for p in model.parameters())}))
"""


def test_loading_a_checkpoint_adds_no_copy_of_its_weights_to_the_heap(tmp_path: Path) -> None:
    # Layers of a few MiB each: glibc serves them from its heap, where a freed copy stays resident (a random
    # initialisation of the whole model, overwritten by the loaded weights, used to stay there: +1x the weights).
    model = DecoderLM.from_preset("llama-tiny", vocab_size=1000, d_model=512, d_ff=1024, n_layers=4, n_heads=8,
                                  dropout=0.0)
    model.save_pretrained(tmp_path / "model")
    DecoderLM.from_preset("llama-tiny", dropout=0.0).save_pretrained(tmp_path / "tiny")
    del model
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "model"), str(tmp_path / "tiny")],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["weights"] > 30 * 2**20
    # Fresh weights are mapped from the safetensors file (file-backed, shared, never anonymous).
    assert figures["grown"] < 0.2 * figures["weights"], figures


def test_release_freed_memory_returns_freed_heap_blocks() -> None:
    blocks = [bytearray(64 * 1024) for _ in range(1024)]  # 64 MiB of heap blocks below glibc's mmap threshold
    for block in blocks:
        block[::4096] = b"\x01" * len(block[::4096])  # resident
    keep = blocks[-1]  # the heap's top stays in use: only malloc_trim gives back what lies below it
    del blocks
    held = process_memory()["anonymous"]
    assert release_freed_memory()
    assert process_memory()["anonymous"] < held - 32 * 2**20
    assert keep[0] == 1


def test_heap_breakdown_tells_python_objects_from_malloc_and_counts_fragmented_arenas() -> None:
    before = heap_breakdown()
    assert 0 < before["python_objects"] <= before["python_arenas"] and before["malloc_in_use"] > 0
    objects = [(i, float(i)) for i in range(300_000)]  # ~30 MB of small objects: pymalloc's arenas
    grown = heap_breakdown()
    assert grown["python_objects"] - before["python_objects"] > 20 * 2**20
    assert grown["python_arenas"] - before["python_arenas"] > 20 * 2**20
    keep = objects[::2000]  # one object in each arena or so keeps the arena: freed objects' space stays resident
    del objects
    fragmented = heap_breakdown()
    assert fragmented["python_objects"] - before["python_objects"] < 5 * 2**20
    assert fragmented["python_arenas"] - before["python_arenas"] > 10 * 2**20  # what anonymous memory counts
    blocks = [bytearray(64 * 1024) for _ in range(256)]  # 16 MiB of heap blocks below malloc's mmap threshold
    assert heap_breakdown()["malloc_in_use"] - fragmented["malloc_in_use"] > 12 * 2**20
    assert len(keep) == 150 and len(blocks) == 256


def test_memory_figures_of_a_process_tree_add_up() -> None:
    me = process_memory()
    assert 0 < me["uss"] <= me["pss"] <= me["rss"] and 0 < me["anonymous"] <= me["rss"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
        tree = tree_memory(os.getpid())
        assert tree["processes"] >= 2 and tree["pss"] > process_memory()["pss"]
    finally:
        child.kill()
        child.wait()


def test_the_pools_track_the_blocks_in_use() -> None:
    model = DecoderLM.from_preset("llama-tiny", dropout=0.0).eval()
    engine = Engine(model, block_size=4, max_num_seqs=8, max_model_len=64)
    assert engine.runner.nbytes == 0  # nothing allocated before the first step
    engine.generate([[5 + i, 6, 7, 8, 9] for i in range(6)], max_tokens=6)
    per_block = engine.runner.block_nbytes()
    # Doubling: at most twice the most blocks ever in use, never the cache's limit (128 blocks here).
    assert engine.peak_blocks * per_block <= engine.runner.nbytes <= 2 * engine.peak_blocks * per_block
    assert engine.runner.nbytes < engine.allocator.n_blocks * per_block / 4


def _traced_graphs() -> dict[int, weakref.ref]:
    """Weak references to the live FX graphs that dynamo traced (their nodes carry fake example values)."""
    return {id(o): weakref.ref(o) for o in gc.get_objects()
            if issubclass(type(o), torch.fx.GraphModule) and any("example_value" in n.meta for n in o.graph.nodes)}


def test_release_compile_state_frees_the_traced_graph_and_keeps_the_compiled_one() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 3).relu().sum(-1)

    before = _traced_graphs()
    compiled_fn = torch.compile(compiled.own_code(fn), backend="inductor")
    x = torch.randn(4, 8)
    expected = compiled_fn(x)
    new = {k: r for k, r in _traced_graphs().items() if k not in before}
    assert new, "dynamo keeps the traced graph after compiling (what release_compile_state frees)"
    graphs = compiled_graph_count()
    assert release_compile_state() >= 1
    gc.collect()
    assert all(r() is None for r in new.values())
    torch.testing.assert_close(compiled_fn(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled_fn(x), fn(x))
    assert compiled_graph_count() == graphs  # the compiled graph still runs: nothing recompiled


def test_a_compiled_engine_keeps_no_traced_graph_and_its_outputs() -> None:
    model = DecoderLM.from_preset("llama-tiny", dropout=0.0).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    expected = [o.token_ids for o in Engine(model, max_num_seqs=4).generate(prompts, max_tokens=5)]
    before = _traced_graphs()
    engine = Engine(model, max_num_seqs=4, compile="attention")
    assert [o.token_ids for o in engine.generate(prompts, max_tokens=5)] == expected
    graphs = compiled_graph_count()
    assert graphs > 0
    assert not [k for k in _traced_graphs() if k not in before]  # freed after the step that compiled
    assert [o.token_ids for o in engine.generate(prompts, max_tokens=5)] == expected
    assert compiled_graph_count() == graphs
