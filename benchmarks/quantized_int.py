"""The ``int8`` and ``int4`` layers' products against ``F.linear`` on float32, and the kernels they could use instead.

    python -m benchmarks.quantized_int                  # SmolLM2-135M's shapes, 1 and 16 rows, one thread (~3 min)
    python -m benchmarks.quantized_int --rows 1 --no-compiled
    python -m benchmarks.quantized_int --quick          # tiny shapes: checks that the script runs

For each weight shape of SmolLM2-135M (576x576 attention, 1536x576 up/gate, 576x1536 down, 49152x576 head; random
weights) and each row count, one process times, interleaved A B A B (median of ``--steps`` rounds, each round
long enough to time), in ms per product and as a ratio to ``F.linear`` on the float32 weight of the same run:

- **fp32**: ``F.linear(x, weight)`` (the reference, ratio 1);
- **int8 layer** / **int4 layer**: ``Int8Linear`` / ``Int4Linear`` (group 64, asymmetric; and group 128 where it
  divides the width) as shipped: eager on float32 inputs;
- the eager alternatives: for int8, ``torch._weight_int8pack_mm`` (torch's CPU kernel for int8 weights), a float
  copy of the whole weight and BLAS (only where it is at most ``CHUNK_ELEMENTS``), and copies of 2^22 and 2^18
  elements a chunk; for int4, ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on float32 inputs (its packed weight
  built once, outside the timing), ``decode()`` (the chain of operations inductor fuses) at 2^22 elements a chunk
  and BLAS, and the layer's in-place unpacking at 2^22 elements a chunk; the int4 kernel on bfloat16 inputs
  (bfloat16 scales and zeros) is listed too, though its rounding is bfloat16's;
- **compiled** (rows <= ``MAX_ROWS``, unless ``--no-compiled``): each layer, ``F.linear`` and ``small_rows_linear``
  (what compiled decoding multiplies a float weight with) under ``torch.compile`` (inductor, static shapes, no
  gradients): the fused reductions decoding uses.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.compare import Table
from blocks.quantized import CHUNK_ELEMENTS, Int4Linear, Int8Linear
from blocks.small_matmul import MAX_ROWS, small_rows_linear

#: (out, in) of SmolLM2-135M's products: attention projections, FFN up/gate, FFN down, the (tied) head.
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
QUICK_SHAPES = [(64, 64), (96, 128)]


def timed(fns: dict[str, Callable[[], object]], steps: int, budget: float = 0.01) -> dict[str, float]:
    """Median seconds per call of each function: rounds A B A B ..., each function called enough times per round
    to take ~``budget`` seconds (counted once, after a warm-up call)."""
    repeats = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        fn()
        repeats[name] = max(1, int(budget / max(time.perf_counter() - start, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            times[name].append((time.perf_counter() - start) / repeats[name])
    return {name: statistics.median(t) for name, t in times.items()}


def chunked(x: torch.Tensor, out: int, chunk: int, rows_of: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """``F.linear`` of ``x`` with the weight ``rows_of(start, stop)`` gives, ``chunk`` elements at a time."""
    step = max(1, chunk // x.shape[1])
    return torch.cat([F.linear(x, rows_of(start, start + step)) for start in range(0, out, step)], dim=-1)


def eager_variants(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Name -> product of ``x`` with ``weight`` (quantized or not) for every eager variant measured."""
    out, width = weight.shape
    int8 = Int8Linear.from_float(weight)
    q, scale = int8.weight_int8, int8.scale
    fns: dict[str, Callable[[], object]] = {
        "fp32 F.linear": lambda: F.linear(x, weight),
        "int8 layer": lambda: int8.linear(x),
        "int8 _weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, q, scale),
        "int8 copy 2^22 + BLAS": lambda: chunked(x, out, 1 << 22, lambda a, b: q[a:b].float()) * scale,
        "int8 copy 2^18 + BLAS": lambda: chunked(x, out, 1 << 18, lambda a, b: q[a:b].float()) * scale,
    }
    if out * width <= CHUNK_ELEMENTS:
        fns["int8 whole copy + BLAS"] = lambda: F.linear(x, q.float()) * scale
    for group in (64, 128):
        if width % group == 0:
            layer = Int4Linear.from_float(weight, group_size=group)
            fns[f"int4 g{group} layer"] = lambda layer=layer: layer.linear(x)
    int4 = Int4Linear.from_float(weight, group_size=64)
    halves = int4.qweight.view(out, -1, 1, 32)
    nibbles = torch.cat([halves & 15, halves >> 4], dim=2).reshape(out, width).int()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    pairs = torch.stack([int4.scale.t(), int4.zero.t()], -1).contiguous()
    xb = x.bfloat16()
    fns.update({
        "int4 g64 _weight_int4pack_mm f32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, pairs),
        "int4 g64 decode 2^22 + BLAS": lambda: chunked(x, out, 1 << 22, lambda a, b: int4.unpack(slice(a, b))),
        "int4 g64 in-place 2^22 + BLAS": lambda: chunked(x, out, 1 << 22, int4._unpack_rows),
        "int4 g64 layer, bf16 x (kernel)": lambda: int4.linear(xb),
    })
    return fns


def compiled_variants(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Name -> compiled product (inductor, static shapes) of ``x`` with ``weight``, for decoding's row counts."""
    width = weight.shape[1]
    layers = {"fp32 F.linear": torch.nn.Linear(width, weight.shape[0], bias=False),
              "int8 layer": Int8Linear.from_float(weight),
              "int4 g64 layer": Int4Linear.from_float(weight, group_size=64)}
    layers["fp32 F.linear"].weight.data = weight
    fns = {}
    for name, layer in layers.items():
        compiled = torch.compile(layer.eval(), dynamic=False, fullgraph=True)
        fns[f"compiled {name}"] = lambda c=compiled: c(x)
    # What compiled decoding multiplies a float weight with (SmallRowsLinear routes F.linear there).
    reduction = torch.compile(small_rows_linear, dynamic=False, fullgraph=True)
    fns["compiled fp32 small_rows_linear"] = lambda: reduction(x, weight)
    return fns


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=9, help="interleaved rounds (median)")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled products")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: checks that the script runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes, steps = (QUICK_SHAPES, 2) if args.quick else (SHAPES, args.steps)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}")
    for out, width in shapes:
        torch.manual_seed(0)
        weight = torch.randn(out, width) * 0.05
        table = Table(f"{out}x{width}", ["product", *(f"{r} row(s) ms" for r in args.rows),
                                         *(f"{r} row(s) / fp32" for r in args.rows)])
        results: dict[str, dict[int, float]] = {}
        for rows in args.rows:
            x = torch.randn(rows, width)
            with torch.no_grad():
                fns = eager_variants(weight, x)
                if not args.no_compiled and rows <= MAX_ROWS:
                    fns.update(compiled_variants(weight, x))
                for name, secs in timed(fns, steps).items():
                    results.setdefault(name, {})[rows] = secs
        for name, by_rows in results.items():
            reference = results["fp32 F.linear"]
            ms = [f"{by_rows[r] * 1e3:.3f}" if r in by_rows else "-" for r in args.rows]
            ratio = [f"{by_rows[r] / reference[r]:.2f}x" if r in by_rows else "-" for r in args.rows]
            table.rows.append([name, *ms, *ratio])
        table.notes.append("ratios: time / fp32 F.linear's time in the same run (lower is faster)")
        print(table.render(), flush=True)


if __name__ == "__main__":
    main()
