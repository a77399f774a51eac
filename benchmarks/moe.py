"""The ``moe`` FFN block against ``transformers``' sparse MoE blocks on the same weights and tokens.

``python -m benchmarks.moe`` times forward + backward (fp32, CPU) of a Mixtral-shaped layer (8 experts, top-2) and a
Qwen3-MoE-shaped layer (64 experts, top-8, renormalised) at reduced width, competitors interleaved A B A B, medians
of ``--repeats``; the outputs are checked equal first. ``--tokens`` sets the batch (tokens through the layer).

``--clock cpu`` (the default) times each step by the process's CPU time rather than the wall clock: with one thread
(``OMP_NUM_THREADS=1``) that is the work the step did, and time the process spent descheduled on a shared machine
does not count (wall-clock ratios there moved by a third between runs). The last three columns bound what any
implementation can reach at these shapes: the nine expert matmuls per (token, slot) pair (three forward, six
backward) alone, at the zoo's routing of the same tokens; the same FLOPs at the fastest matmul rate this machine
showed in the run (best of 5 over a 1024³ product and the layer's per-expert shapes); and ``transformers``'
``grouped_mm`` time over each, the largest speed-up over it that such an implementation could show.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import transformers
from torch import nn

import blocks

SHAPES = {
    # name: (transformers config class, block class, config fields, zoo options)
    "mixtral (8 experts, top-2)": ("MixtralConfig", "models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                                   dict(hidden_size=512, intermediate_size=1024, num_local_experts=8,
                                        num_experts_per_tok=2), dict(n_experts=8, top_k=2, renormalize=True), 1024),
    "qwen3_moe (64 experts, top-8)": ("Qwen3MoeConfig", "models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
                                      dict(hidden_size=512, moe_intermediate_size=256, num_experts=64,
                                           num_experts_per_tok=8, norm_topk_prob=True),
                                      dict(n_experts=64, top_k=8, renormalize=True), 256),
}


def _hf_block(config_class: str, path: str, fields: dict, experts: str) -> nn.Module:
    module_path, name = path.rsplit(".", 1)
    module = __import__(f"transformers.{module_path}", fromlist=[name])
    config = getattr(transformers, config_class)(**fields)
    config._experts_implementation = experts  # what a model built from the config would set
    return getattr(module, name)(config)


def copy_weights(zoo: nn.Module, hf: nn.Module) -> nn.Module:
    """``hf`` holding ``zoo``'s router and expert weights."""
    with torch.no_grad():
        hf.gate.weight.copy_(zoo.router.weight)
        for e, expert in enumerate(zoo.experts):
            hf.experts.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]))
            hf.experts.down_proj[e].copy_(expert.down_proj.weight)
    return hf


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def step_time(block: nn.Module, x: torch.Tensor, clock: Callable[[], float] = time.process_time) -> float:
    """Seconds of one forward + backward."""
    x = x.detach().requires_grad_(True)
    start = clock()
    block(x).sum().backward()
    return clock() - start


def matmul_time(counts: list[int], d_model: int, d_ff: int, clock: Callable[[], float] = time.process_time) -> float:
    """Seconds of the experts' matmuls alone: per expert of ``n`` pairs the gate, up and down projections forward
    and the input and weight gradients of each backward, on random tensors of those shapes (three weights per
    expert, as in the layer)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(torch.randn(n, d_model, generator=g), torch.randn(n, d_ff, generator=g),
               torch.randn(d_ff, d_model, generator=g), torch.randn(d_ff, d_model, generator=g),
               torch.randn(d_model, d_ff, generator=g)) for n in counts if n]
    start = clock()
    for x, h, w_gate, w_up, w_down in shapes:
        x @ w_gate.T, x @ w_up.T, h @ w_down.T  # forward: gate, up, down
        dy = x  # (n, d_model), the shape of the output gradient
        dy @ w_down, dy.T @ h, h @ w_gate, h.T @ x, h @ w_up, h.T @ x  # backward: down, gate, up
    return clock() - start


def peak_rate(shapes: list[tuple[int, int, int]], clock: Callable[[], float] = time.process_time,
              repeats: int = 5) -> float:
    """FLOP/s of the fastest product among ``(m, k, n)`` shapes (best of ``repeats``): the rate no implementation's
    matmuls beat on this machine, so FLOPs ÷ it is a floor below the measured one."""
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        for _ in range(repeats):
            start = clock()
            a @ b
            best = max(best, 2 * m * k * n / max(clock() - start, 1e-9))
    return best


def measure(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: process CPU time (use with OMP_NUM_THREADS=1); wall: elapsed time")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"fp32, {args.tokens} tokens, forward + backward, median of {args.repeats}, {args.clock} time")
    print("| layer | zoo ms | transformers grouped_mm ms (zoo speed-up) | transformers eager ms (zoo speed-up) "
          "| expert matmuls alone ms | FLOP floor ms (GFLOP at peak GFLOP/s) | grouped_mm ÷ matmuls (÷ FLOP floor) |")
    print("|---|---|---|---|---|---|---|")
    for name, (config_class, path, fields, options, d_ff) in SHAPES.items():
        torch.manual_seed(0)
        zoo = blocks.build("ffn", "moe", d_model=fields["hidden_size"], d_ff=d_ff, **options)
        with torch.no_grad():
            for p in zoo.parameters():
                p.normal_(0, 0.05)
        runs: dict[str, Callable[[], float]] = {}
        x = torch.randn(1, args.tokens, fields["hidden_size"], generator=torch.Generator().manual_seed(1))
        for experts in ("grouped_mm", "eager"):
            hf = copy_weights(zoo, _hf_block(config_class, path, fields, experts))
            with torch.no_grad():
                torch.testing.assert_close(zoo(x), hf(x), atol=1e-5, rtol=1e-4)
            runs[experts] = functools.partial(step_time, hf, x, clock)
        runs["zoo"] = functools.partial(step_time, zoo, x, clock)
        with torch.no_grad():
            chosen = zoo.route(zoo.router(x.reshape(-1, x.shape[-1])))[1]
        counts = torch.bincount(chosen.reshape(-1), minlength=zoo.n_experts).tolist()
        runs["matmuls"] = functools.partial(matmul_time, counts, fields["hidden_size"], d_ff, clock)
        t = measure(runs, args.repeats)
        d, n = fields["hidden_size"], args.tokens * zoo.top_k // zoo.n_experts  # a mean expert's rows
        peak = peak_rate([(1024, 1024, 1024), (n, d, d_ff), (n, d_ff, d), (d, n, d_ff), (d_ff, n, d)], clock)
        flops = 9 * 2 * args.tokens * zoo.top_k * d * d_ff  # nine products per (token, slot) pair
        floor = flops / peak
        print(f"| {name} | {t['zoo'] * 1e3:.1f} | {t['grouped_mm'] * 1e3:.1f} ({t['grouped_mm'] / t['zoo']:.2f}x) | "
              f"{t['eager'] * 1e3:.1f} ({t['eager'] / t['zoo']:.2f}x) | {t['matmuls'] * 1e3:.1f} | "
              f"{floor * 1e3:.1f} ({flops / 1e9:.1f} at {peak / 1e9:.0f}) | "
              f"{t['grouped_mm'] / t['matmuls']:.2f}x ({t['grouped_mm'] / floor:.2f}x) |")


if __name__ == "__main__":
    main()
