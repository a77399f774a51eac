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


DEAD_RANK_WORKER = """
import os, sys, time
import torch, torch.distributed as dist
from training.distributed import init_distributed
init_distributed(backend="gloo", timeout_s=float(sys.argv[1]))
x = torch.ones(4)
dist.all_reduce(x)                        # both alive: fine
if dist.get_rank() == 1:
    os._exit(7)                           # a rank dies without a word
start = time.monotonic()
try:
    dist.all_reduce(x)
except Exception as err:                  # the survivor must fail, not hang
    print(f"FAILED after {time.monotonic() - start:.1f}s: {type(err).__name__}: {err}", flush=True)
    os._exit(3)
print("no error", flush=True)
"""


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_a_dead_rank_makes_the_others_fail_within_the_timeout() -> None:
    """A collective with a dead peer raises in the surviving process (gloo notices the closed connection, or the
    collective times out after ``timeout_s``) instead of hanging forever."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout_s = 10
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", DEAD_RANK_WORKER, str(timeout_s)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        survivor_out, survivor_err = procs[0].communicate(timeout=timeout_s + 60)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].wait() == 7
    assert procs[0].returncode == 3, survivor_out + survivor_err[-2000:]
    seconds = float(survivor_out.split("FAILED after ")[1].split("s:")[0])
    assert seconds <= timeout_s + 5, survivor_out
