"""Per-process memory and throughput of sharded training: FSDP2 against DDP on 1, 2 and 4 CPU processes.

    python -m benchmarks.distributed                 # DecoderLM d_model 256, 4 layers (~10 minutes on 2 cores)
    python -m benchmarks.distributed --quick         # tiny shapes: checks that the script runs
    python -m benchmarks.distributed --processes 1 2 --modes ddp fsdp tp

Every configuration runs in a fresh ``torchrun`` (gloo), training the same model on the same global batch
with AdamW. Memory is what each process holds in model state after a step, counted from the live tensors
(the local shards of parameters, gradients and optimiser state; FSDP2 should approach 1/N of the DDP
figure), plus the peak resident set (VmHWM) of each process. Throughput is tokens per second over the timed
steps after warm-up, against DDP with the same number of processes measured in the same run. CPU processes
here share 2 cores, so more processes do not compute faster: the figures show the sharding and the cost
of its communication, not a speed-up.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _local_bytes(tensors) -> int:
    from training.parallel import is_dtensor

    total = 0
    for t in tensors:
        t = t.to_local() if is_dtensor(t) else t
        total += t.numel() * t.element_size()
    return total


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> None:
    """One configuration, inside torchrun: train, measure, and let rank 0 write the figures."""
    from models import DecoderLM
    from training import CausalLMCollator, Trainer, TrainerConfig, cleanup, init_distributed
    from training.distributed import barrier, is_distributed
    from training.parallel import parallel_layout

    context = init_distributed("gloo")
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads,
                                  d_ff=4 * args.d_model, n_layers=args.layers, max_len=args.seq_len, dropout=0.0)
    n_params = model.num_parameters()
    dp, _ = parallel_layout(args.mode, context.world_size, context.world_size if args.mode == "tp" else None)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(5, args.vocab, (args.batch * (args.steps + args.warmup), args.seq_len), generator=g).tolist()
    config = TrainerConfig(max_steps=args.steps + args.warmup, batch_size=args.batch // dp, max_grad_norm=1.0,
                           progress=False, device="cpu", parallel=args.mode, shuffle=False)
    trainer = Trainer(model, functools.partial(torch.optim.AdamW, lr=1e-3), config, data,
                      CausalLMCollator(pad_token_id=0))
    trainer.train(until=args.warmup)
    params = list(trainer.model.parameters())
    # Gradients are freed by the next zero_grad: count them right after a backward, before the step.
    grad_bytes = []
    hook = trainer.optimizer.register_step_pre_hook(
        lambda *_: grad_bytes.append(_local_bytes(p.grad for p in params if p.grad is not None)))
    barrier()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    hook.remove()
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    figures = torch.tensor([_local_bytes(params), max(grad_bytes), _local_bytes(state), _peak_rss()],
                           dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(context.world_size)]
    if is_distributed():
        torch.distributed.all_gather(gathered, figures)
    else:
        gathered = [figures]
    if context.is_main:
        tokens = sum(r["tokens"] for r in trainer.history[args.warmup:])
        per_rank = torch.stack(gathered).max(0).values.tolist()  # the largest process (shards may be uneven)
        Path(args.json).write_text(json.dumps({
            "mode": args.mode, "processes": context.world_size, "parameters": n_params,
            "param_bytes": per_rank[0], "grad_bytes": per_rank[1], "optim_bytes": per_rank[2],
            "peak_rss": per_rank[3], "tokens_per_s": tokens / seconds,
        }))
    cleanup()


def run(mode: str, processes: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(Path(__file__).resolve()), "--worker", "--mode", mode, "--json", str(out),
               *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("vocab", "d_model", "heads", "layers", "seq_len", "batch", "steps", "warmup")]]
        threads = max(1, (os.cpu_count() or 1) // processes)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(f"{mode} on {processes} processes failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp", "tp"])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows per step over all processes)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return []
    if args.quick:
        args.vocab, args.d_model, args.layers, args.seq_len, args.steps, args.warmup = 256, 32, 2, 16, 2, 1
    rows = [run(mode, n, args) for n in args.processes for mode in args.modes]
    one = {r["mode"]: r for r in rows if r["processes"] == 1}
    ddp = {r["processes"]: r for r in rows if r["mode"] == "ddp"}
    mib = 2.0 ** 20
    print(f"DecoderLM: {rows[0]['parameters']:,} parameters, global batch {args.batch} x {args.seq_len} tokens, "
          f"AdamW, fp32, gloo on {os.cpu_count()} CPU cores")
    print(f"{'mode':<6}{'procs':>6}{'params MiB':>12}{'grads MiB':>11}{'AdamW MiB':>11}{'state MiB':>11}"
          f"{'vs 1 proc':>10}{'peak RSS MiB':>14}{'tokens/s':>10}{'vs DDP':>8}")
    for r in rows:
        state = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        base = one.get(r["mode"]) or one.get("ddp")
        base_state = base["param_bytes"] + base["grad_bytes"] + base["optim_bytes"] if base else float("nan")
        speed = r["tokens_per_s"] / ddp[r["processes"]]["tokens_per_s"] if r["processes"] in ddp else float("nan")
        print(f"{r['mode']:<6}{r['processes']:>6}{r['param_bytes'] / mib:>12.2f}{r['grad_bytes'] / mib:>11.2f}"
              f"{r['optim_bytes'] / mib:>11.2f}{state / mib:>11.2f}{state / base_state:>10.2f}"
              f"{r['peak_rss'] / mib:>14.0f}{r['tokens_per_s']:>10.0f}{speed:>8.2f}")
    return rows


if __name__ == "__main__":
    main()
