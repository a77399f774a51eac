"""Two CPU processes (gloo, launched with torchrun) train exactly like one process on the same global batch."""

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

from models import DecoderLM
from tests.training.ddp_worker import build

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_two_gloo_processes_match_one_process_on_the_global_batch(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "training" / "ddp_worker.py"), str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr[-3000:]

    single = build(batch_size=8, grad_accum_steps=1)
    expected = [r["loss"] for r in single.train()]
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got == pytest.approx(expected, rel=1e-5)

    ddp_model = DecoderLM(single.model.config)
    safetensors.torch.load_model(ddp_model, str(tmp_path / "model.safetensors"))
    for (name, a), b in zip(single.model.state_dict().items(), ddp_model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    initial = build(batch_size=8, grad_accum_steps=1).model.state_dict()
    assert not torch.equal(initial["embed_tokens.weight"], ddp_model.state_dict()["embed_tokens.weight"])
