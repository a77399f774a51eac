"""FSDP2, tensor parallelism and DCP checkpoints on CPU processes (gloo, launched with torchrun):
sharded training equals one process on the same global batch, tensor-parallel forward and backward equal
the unsharded model, and checkpoints move between 1 and 2 processes bit-exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from models import DecoderLM, EncoderLM
from tests.training.parallel_worker import CONFIG, build, build_dpo

ROOT = Path(__file__).resolve().parents[2]
gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                          reason="needs torch.distributed gloo")


def _torchrun(processes: int, scenario: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           str(ROOT / "tests" / "training" / "parallel_worker.py"), scenario, str(out), *extra]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((out / f"{scenario}.json").read_text())


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


@gloo
def test_fsdp_tp_and_checkpoints_across_one_and_two_processes(tmp_path, tiny_llama_dir) -> None:
    # The single-process reference: 4 AdamW steps (with clipping and a schedule) on global batches of 4, and a
    # checkpoint at step 2 for the two processes to resume.
    single = build(tmp_path / "single")
    single.train(until=2)
    single.save_checkpoint()
    safetensors.torch.save_file(_weights(single.model), str(tmp_path / "single_step2.safetensors"))
    expected = [r["loss"] for r in single.train()]
    final = _weights(single.model)

    tuned = {}
    for method in ("dpo", "simpo"):
        trainer = build_dpo(tiny_llama_dir, method=method)
        tuned[method] = ([r["loss"] for r in trainer.train()],
                         {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})

    got = _torchrun(2, "two", tmp_path, str(tiny_llama_dir))

    # DPO (its frozen reference copy sharded like the model) and SimPO through the Trainer under 2-process FSDP2
    # train like one process on the same global batches of pairs.
    start = build_dpo(tiny_llama_dir).model.embed_tokens.weight
    for method, (expected_losses, expected_final) in tuned.items():
        assert got[f"{method}_losses"] == pytest.approx(expected_losses, abs=1e-5), method
        sharded = safetensors.torch.load_file(str(tmp_path / f"{method}_final.safetensors"))
        assert sharded.keys() == expected_final.keys()
        for name, value in sharded.items():
            torch.testing.assert_close(value, expected_final[name], rtol=0, atol=1e-5, msg=f"{method} {name}")
        assert not torch.equal(sharded["embed_tokens.weight"], start), method
    # The first process holds only its half of every reference weight (FSDP2 splits dim 0 as torch.chunk does:
    # ceil(n / 2) rows), and after the reference's forward passes nothing stays gathered (a gathered weight would
    # be a plain tensor of the full shape).
    assert got["reference_sharded"] is True
    assert got["reference"].keys() == {n for n, _ in build_dpo(tiny_llama_dir).model.named_parameters()}
    for name, (kind, local, full) in got["reference"].items():
        assert kind == "DTensor" and local == [(full[0] + 1) // 2, *full[1:]], (name, kind, local, full)
    # FSDP + TP (1 x 2): the reference's attention is split over the two processes too, and DPO trains the same.
    assert got["dpo_tp_losses"] == pytest.approx(tuned["dpo"][0], abs=1e-5)
    assert got["tp_reference"] and all(shape == [16, 32] for shape in got["tp_reference"].values()), got["tp_reference"]

    # 2-process FSDP2 trains like one process: the same losses, weights within 1e-5 after 4 AdamW steps.
    assert got["fsdp_losses"] == pytest.approx(expected, rel=1e-5)
    exported = DecoderLM.from_pretrained(tmp_path / "export")  # the consolidated checkpoint a sharded run writes
    assert set((tmp_path / "export").iterdir()) >= {tmp_path / "export" / "model.safetensors"}
    for name, value in _weights(exported).items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=1e-5, msg=name)
    assert not torch.equal(exported.embed_tokens.weight, build(tmp_path / "x").model.embed_tokens.weight)

    # Written by 1 process, resumed by 2 (a 1 x 2 FSDP + TP mesh): bit-exact weights, then the same curve.
    assert got["bit_exact_from_one"] is True
    assert got["resumed_losses"][:2] == expected[:2]  # the history comes from the checkpoint
    assert got["resumed_losses"][2:] == pytest.approx(expected[2:], rel=1e-5)

    # Written by 2 FSDP processes, resumed by 1: bit-exact weights, then the same curve.
    resumed = build(tmp_path / "fsdp")
    with pytest.raises(ValueError, match="written by 2 process.es., this run has 1"):
        resumed.load_checkpoint("latest")
    resumed.load_checkpoint("latest", allow_world_size_change=True)
    saved = safetensors.torch.load_file(str(tmp_path / "fsdp_step2.safetensors"))
    for name, value in _weights(resumed.model).items():
        assert torch.equal(value, saved[name]), name
    assert [r["loss"] for r in resumed.train()] == pytest.approx(got["fsdp_losses"], rel=1e-6)


@gloo
def test_fsdp_shards_a_mixture_of_experts_model_like_one_process(tmp_path) -> None:
    # The router's load-balancing loss is computed per forward pass (as transformers does), so the one-process
    # reference accumulates two micro-batches of 2: the forward passes each of the 2 FSDP processes makes.
    single = build(tmp_path / "single", moe=True, grad_accum_steps=2)
    expected = [r["loss"] for r in single.train()]
    final = _weights(single.model)
    got = _torchrun(2, "moe", tmp_path)
    assert got["losses"] == pytest.approx(expected, rel=1e-5)
    saved = safetensors.torch.load_file(str(tmp_path / "moe_final.safetensors"))
    assert any("experts" in name for name in saved)
    for name, value in saved.items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=1e-5, msg=name)


@gloo
@pytest.mark.slow  # 4 processes on 2 cores: ~30 s; the fast test above covers FSDP, TP and the 2-D mesh code (1 x 2)
def test_four_processes_train_on_a_two_by_two_fsdp_tp_mesh(tmp_path) -> None:
    got = _torchrun(4, "four", tmp_path)
    assert (got["dp_size"], got["tp_size"]) == (2, 2)
    single = build(tmp_path / "single")
    expected = [r["loss"] for r in single.train(until=3)]
    assert got["losses"] == pytest.approx(expected, rel=1e-5)
    assert got["losses"][-1] < got["losses"][0]


def test_tensor_parallel_plan_covers_every_block_and_checks_divisibility() -> None:
    from blocks.parallel import tensor_parallel_plan

    model = DecoderLM.from_preset("tiny", **CONFIG)
    plan = tensor_parallel_plan(model, 2)
    styles = {name.rsplit(".", 1)[-1]: type(style).__name__ for name, style in plan.items()}
    assert styles == {"q_proj": "ColwiseParallel", "k_proj": "ColwiseParallel", "v_proj": "ColwiseParallel",
                      "o_proj": "RowwiseParallel", "gate_proj": "ColwiseParallel", "up_proj": "ColwiseParallel",
                      "down_proj": "RowwiseParallel"}
    assert len(plan) == 7 * CONFIG["n_layers"]
    with pytest.raises(ValueError, match="does not divide n_kv_heads=2"):
        tensor_parallel_plan(model, 4)  # 4 query heads, but GQA's 2 key/value heads cannot be split in 4
    with pytest.raises(ValueError, match="does not divide n_heads=4"):
        tensor_parallel_plan(model, 3)
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        tensor_parallel_plan(model, 0)
    with pytest.raises(ValueError, match="no attention or feed-forward block"):
        tensor_parallel_plan(torch.nn.Linear(2, 2), 2)
    encoder = EncoderLM.from_preset("tiny", **{**CONFIG, "n_kv_heads": 4, "d_ff": 30})
    with pytest.raises(ValueError, match="does not divide the feed-forward width d_ff=30"):
        tensor_parallel_plan(encoder, 4)


def test_parallel_layouts_are_validated() -> None:
    from training.parallel import parallel_layout

    assert parallel_layout("fsdp+tp", 4, 2) == (2, 2)
    assert parallel_layout("tp", 2) == (1, 2)
    assert parallel_layout("fsdp", 4) == (4, 1)
    with pytest.raises(ValueError, match="parallel must be one of"):
        parallel_layout("zero3", 2)
    with pytest.raises(ValueError, match="tp_size=3 does not divide the world size 4"):
        parallel_layout("fsdp+tp", 4, 3)
    with pytest.raises(ValueError, match="tp_size must equal the world size 2"):
        parallel_layout("tp", 2, 4)
    with pytest.raises(ValueError, match="mixed_precision='bf16' is FSDP2's policy"):
        from training.parallel import apply_parallelism

        apply_parallelism(torch.nn.Linear(2, 2), "fsdp", torch.device("cpu"), mixed_precision="bf16")
