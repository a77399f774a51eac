"""``Engine(compile="aot")``: the decode-only steps compiled ahead of time by AOTInductor in a child process
(``serving.aot_steps``, ``serving.aot_export``) and run from packages the engine's process loads without importing
the compiler.

Checked: the tokens and step logits of a staggered run (a lone request, then batches whose rows, blocks and pools
grow) equal the eager engine's and each request's alone, with every package run (one row, 2–3 rows, 4 rows); the
4-row package multiplies through oneDNN and the others through BLAS (the one-row package through neither); a
process that loads the packages from disk imports neither dynamo nor inductor; the packages are compiled for the
engine's thread count; the package key follows what the graphs depend on; a model its config does not rebuild is
compiled in-process instead; a failed compile or a package whose logits differ leaves the steps eager with the same
tokens; a compile process killed midway leaves no package behind.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from models import DecoderLM
from serving import Engine, aot_export, aot_steps
from serving.aot_export import KINDS, NOT_EXPORTABLE
from serving.aot_steps import AheadOfTimeSteps, PackagedStep, package_key
from serving.runner import DynamicStep

from .test_engine import alone, run_staggered

pytestmark = pytest.mark.usefixtures("one_thread")

#: Prompt lengths and output lengths; a lone request first, then arrivals while others decode.
LENGTHS = [(5, 9), (13, 14), (3, 10), (22, 11), (9, 12)]
ARRIVALS = {0: [0], 12: [1, 2], 14: [3], 16: [4]}
LIMITS = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64)
#: The model, written out for the child process of ``test_a_process_loading_the_packages_imports_no_compiler``.
MODEL_SOURCE = """
import torch
from models import DecoderLM

def thin_model():
    torch.manual_seed(0)
    model = DecoderLM.from_preset("qwen3-tiny", n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_head=8, d_ff=32,
                                  vocab_size=97).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model
"""


def thin_model() -> DecoderLM:
    """Two layers of width 16 (GQA, rotary, qk-norm), weights scaled so that greedy tokens vary."""
    scope: dict[str, Any] = {}
    exec(MODEL_SOURCE, scope)  # noqa: S102 - the same source the child process runs
    return scope["thin_model"]()


def arrivals(prompts: list[list[int]]) -> dict[int, list[tuple[list[int], dict]]]:
    return {step: [(prompts[i], dict(max_tokens=LENGTHS[i][1], logprobs=5)) for i in items]
            for step, items in ARRIVALS.items()}


def assert_same_outputs(got: list, want: list) -> None:
    """Tokens equal; each chosen token's log-probability and the top 5 within float32 rounding."""
    for a_out, b_out in zip(got, want, strict=True):
        assert a_out.token_ids == b_out.token_ids
        for a, b in zip(a_out.logprobs, b_out.logprobs, strict=True):
            assert a.token_id == b.token_id and list(a.top) == list(b.top)
            torch.testing.assert_close(torch.tensor([a.logprob, *a.top.values()]),
                                       torch.tensor([b.logprob, *b.top.values()]), rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One staggered run on an engine whose packages were compiled in its child process, and one eager."""
    cache = tmp_path_factory.mktemp("aot-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZOO_AOT_CACHE", str(cache))
        model = thin_model()
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n, _ in LENGTHS]
        engine = Engine(model, compile="aot", **LIMITS)
        process = engine.runner.aot.process
        assert engine.runner.aot.wait(600), engine.runner.aot.failed
        outputs = run_staggered(engine, arrivals(prompts))
        eager = run_staggered(Engine(model, compile=False, **LIMITS), arrivals(prompts))
        yield dict(model=model, prompts=prompts, engine=engine, outputs=outputs, eager=eager, cache=cache,
                   process=process)


def test_tokens_and_step_logits_equal_the_eager_engine_and_each_request_alone(run: dict[str, Any]) -> None:
    runner = run["engine"].runner
    assert run["process"] is not None and run["process"].returncode == 0  # compiled in a child process
    assert set(runner.aot.steps) == set(KINDS) and runner.aot.failed is None
    assert runner.single is runner.aot.steps["single"] and runner.step is runner.aot.steps["batch"]
    assert runner.wide is runner.aot.steps["wide"]
    assert runner.single.calls >= LENGTHS[0][1] - 1  # the lone request's every decode step
    assert runner.step.calls > 0  # the steps of 2 or 3 decoding rows
    assert runner.wide.calls > 0  # and of WIDE_ROWS (the engine's max_num_seqs)
    assert runner.single.checked and runner.step.checked and runner.wide.checked  # against eager at first use
    assert_same_outputs(run["outputs"], run["eager"])
    order = [i for step in sorted(ARRIVALS) for i in ARRIVALS[step]]
    for i, out in zip(order, run["outputs"], strict=True):
        assert out.token_ids == alone(run["model"], run["prompts"][i], LENGTHS[i][1])


def test_the_pools_grow_with_the_blocks_in_use(run: dict[str, Any]) -> None:
    engine = run["engine"]
    per_block = engine.runner.block_nbytes()
    held = engine.runner.nbytes // per_block
    assert engine.peak_blocks <= held <= 2 * engine.peak_blocks < engine.allocator.n_blocks


def test_a_process_loading_the_packages_imports_no_compiler(run: dict[str, Any], tmp_path: Path) -> None:
    """A second engine of the same model loads the packages from disk (no compile process) and runs them in a
    process where neither ``torch._dynamo`` nor ``torch._inductor`` is ever imported, nor sympy (which the eager
    engine does not import either: 25 MiB of objects)."""
    script = tmp_path / "serve.py"
    script.write_text(MODEL_SOURCE + f"""
import json, sys
from serving import Engine
torch.set_num_threads({torch.get_num_threads()})  # the packages were compiled for this count (part of their key)
engine = Engine(thin_model(), compile="aot", **{LIMITS!r})
assert engine.runner.aot.process is None, "compiled again"
prompts = json.loads(sys.argv[1])
outputs = engine.generate(prompts, max_tokens=8)
print(json.dumps(dict(tokens=[list(o.token_ids) for o in outputs],
                      calls={{k: s.calls for k, s in engine.runner.aot.steps.items()}},
                      modules=sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor",
                                                                             "sympy"))))))
""")
    prompts = run["prompts"][:3]
    env = {**os.environ, "ZOO_AOT_CACHE": str(run["cache"]), "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, str(script), json.dumps(prompts)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["modules"] == []
    assert report["calls"]["batch"] > 0
    want = [o.token_ids for o in Engine(run["model"], compile=False, **LIMITS).generate(prompts, max_tokens=8)]
    assert report["tokens"] == want


def test_the_wide_package_multiplies_through_onednn_the_others_through_blas(run: dict[str, Any]) -> None:
    """The generated code of each package: oneDNN's linear in the wide one only, aten's mm in the others."""
    folder = run["engine"].runner.aot.folder
    for kind in KINDS:
        with zipfile.ZipFile(folder / f"{kind}.pt2") as package:
            code = "".join(package.read(name).decode() for name in package.namelist()
                           if name.endswith(".wrapper.cpp"))
        assert ("aoti_torch_cpu__linear_pointwise(" in code) == (kind == "wide"), kind
        assert ("aoti_torch_cpu_mm_out(" in code or "aoti_torch_cpu_addmm_out(" in code) == (kind == "batch"), kind


def test_the_package_key_follows_what_the_graphs_depend_on(run: dict[str, Any]) -> None:
    model = run["model"]
    key = package_key(model, 4, torch.float32)
    assert package_key(thin_model(), 4, torch.float32) == key  # the same model built again
    assert package_key(model, 8, torch.float32) != key  # another block size
    assert package_key(model, 4, torch.bfloat16) != key
    assert package_key(model, 4, torch.float32, torch.float16) != key  # float16 pools
    assert package_key(model, 4, torch.float32, torch.float32) == key  # the model's own dtype, named
    deeper = DecoderLM.from_preset("qwen3-tiny", n_layers=3, d_model=16, n_heads=2, n_kv_heads=1, d_head=8, d_ff=32,
                                   vocab_size=97)
    assert package_key(deeper, 4, torch.float32) != key


@pytest.mark.parametrize(("change", "message"), [(0.5, "by 0.5 (non-finite where eager's are finite: 0)"),
                                                  (float("nan"), "by nan (non-finite where eager's are finite: 97)")],
                         ids=["off-by-0.5", "nan"])
def test_a_package_whose_logits_differ_is_dropped_and_the_steps_stay_eager(
        run: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, change: float,
        message: str) -> None:
    monkeypatch.setenv("ZOO_AOT_CACHE", str(run["cache"]))
    original = PackagedStep.__call__
    monkeypatch.setattr(PackagedStep, "__call__", lambda self, *args: original(self, *args) + change)
    engine = Engine(run["model"], compile="aot", **LIMITS)
    assert engine.runner.aot.process is None  # loaded from disk
    with caplog.at_level(logging.WARNING, logger="serving.aot_steps"):
        outputs = run_staggered(engine, arrivals(run["prompts"]))
    assert f"differ from the eager step's {message}" in caplog.text
    assert engine.runner.aot.failed and engine.runner.single is None and engine.runner.step is None
    assert_same_outputs(outputs, run["eager"])


def test_a_failed_compile_leaves_the_steps_eager(run: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ZOO_AOT_CACHE", str(tmp_path))
    monkeypatch.setattr(aot_steps, "COMPILER", "serving.no_such_module")
    engine = Engine(run["model"], compile="aot", **LIMITS)
    with caplog.at_level(logging.WARNING, logger="serving.aot_steps"):
        assert not engine.runner.aot.wait(120)
        outputs = run_staggered(engine, arrivals(run["prompts"]))
    assert "the compile process exited with 1" in caplog.text and "no_such_module" in caplog.text
    assert engine.runner.single is None and engine.runner.step is None
    assert_same_outputs(outputs, run["eager"])


def test_the_packages_are_compiled_for_the_engines_thread_count(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """Inductor writes its kernels' parallel loops for a thread count: the engine's goes into the key and the spec,
    and the compile process compiles for it (running on one thread itself)."""
    from torch._inductor import config

    model = thin_model()
    threads = torch.get_num_threads()
    key = package_key(model, 4, torch.float32)
    specs: list[dict] = []
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, file: (specs.append(obj), save(obj, file))[1])
    monkeypatch.setenv("ZOO_AOT_CACHE", str(tmp_path))
    try:
        torch.set_num_threads(threads + 1)
        assert package_key(model, 4, torch.float32) != key
        AheadOfTimeSteps(model, 4, torch.float32).close()
    finally:
        torch.set_num_threads(threads)
    assert specs[0]["threads"] == threads + 1
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(aot_export, "compile_packages",
                        lambda spec: seen.append((config.cpp.threads, torch.get_num_threads())))
    save(specs[0], tmp_path / "again.spec")
    before = config.cpp.threads
    # (config.patch, not monkeypatch: its undo deletes a sub-config's setting, which inductor then cannot read)
    with config.patch({"cpp.threads": config.cpp.threads, "compile_threads": config.compile_threads}):
        try:
            assert aot_export.main([str(tmp_path / "again.spec")]) == 0
        finally:
            torch.set_num_threads(threads)
    assert seen == [(threads + 1, 1)]
    assert config.cpp.threads == before


def test_a_model_its_config_does_not_rebuild_is_compiled_in_process(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """LoRA slots are seen before any process starts; a tensor the config does not build (an extra buffer) by the
    compile process, which exits with ``NOT_EXPORTABLE``: both engines compile as ``compile=True`` does."""
    monkeypatch.setenv("ZOO_AOT_CACHE", str(tmp_path))
    with_slots = Engine(thin_model(), compile="aot", max_loras=2, **LIMITS)
    assert with_slots.runner.aot is None and isinstance(with_slots.runner.step, DynamicStep)
    model = thin_model()
    model.register_buffer("extra", torch.zeros(3))
    engine = Engine(model, compile="aot", **LIMITS)
    assert not engine.runner.aot.wait(120) and engine.runner.aot.process.returncode == NOT_EXPORTABLE
    assert engine.runner.aot.unexportable
    engine.runner.refresh_aot()  # what the next step does first: switch to the in-process graphs
    assert engine.runner.aot is None and isinstance(engine.runner.step, DynamicStep)
    assert list(tmp_path.rglob("*.pt2")) == []


def test_a_compile_process_killed_midway_leaves_no_package(run: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """Killed while it exports or compiles, the process leaves no package: the engine stays eager, and the next
    engine of the model compiles again."""
    monkeypatch.setenv("ZOO_AOT_CACHE", str(tmp_path))
    steps = AheadOfTimeSteps(run["model"], 4, torch.float32)
    time.sleep(3)  # importing torch, rebuilding the model, exporting
    steps.close()
    assert not steps.wait(10)
    assert list(tmp_path.rglob("*.pt2")) == []  # (a staging file, if the kill came during the compile, is not one)
    again = AheadOfTimeSteps(run["model"], 4, torch.float32)
    assert again.process is not None  # not taken for compiled
    again.close()
