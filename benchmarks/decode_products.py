"""BLAS against oneDNN on a batched decoding step's products: why ``zoo serve``'s wide package uses oneDNN, and
prepacks the weights.

    python -m benchmarks.decode_products                     # SmolLM2-135M's and Qwen3-0.6B's shapes, one thread
    python -m benchmarks.decode_products --rows 1 16 --shapes qwen3
    python -m benchmarks.decode_products --quick             # tiny shapes: checks that the script runs

A step of ``R`` decoding rows multiplies ``R`` rows by every weight of the model. For each shape and row count, one
process times the products of ``--layers`` copies of a layer's weights (distinct tensors, so the weights are read
from memory as a deep model's are) and of the head, interleaved A B A B over ``--rounds`` rounds, float32:

- **BLAS**: ``F.linear(x, weight)`` (aten's ``mm``: what inductor lowers a product to by default);
- **oneDNN**: ``serving.aot_export.onednn_linear`` on the same ``(out, in)`` weight, unpacked (what
  ``OneDNNLinears`` traces a product as in the ``"wide"`` package);
- **prepacked**: ``blocks.prepacked_linear.PrepackedLinear`` layers of the same weights, reordered once into
  oneDNN's blocked layout (``Engine(prepack_weights=True)``, ``zoo serve``'s default), called as modules.

It prints GFLOP/s (2 x rows x weights per step) and oneDNN's and the prepacked layers' speed as ratios to BLAS's in
the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.compare import Table
from blocks.prepacked_linear import PrepackedLinear
from serving.aot_export import onednn_linear

#: The products timed, in the table's order.
KERNELS = ("BLAS", "oneDNN", "prepacked")

#: (in, out) of each product of one decoder layer (q, k, v, o, gate, up, down), and the head's.
SHAPES = {
    "smollm2": dict(layer=[(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)],
                    head=(576, 49152)),
    "qwen3": dict(layer=[(1024, 2048), (1024, 1024), (1024, 1024), (2048, 1024), (1024, 3072), (1024, 3072),
                         (3072, 1024)], head=(1024, 151936)),
    "tiny": dict(layer=[(64, 64), (64, 128), (128, 64)], head=(64, 512)),
}


def measure(shape: str, rows: int, layers: int, rounds: int) -> dict[str, float]:
    """Seconds per step of each library (the best round), and the step's FLOP count.

    Args:
        shape: a key of ``SHAPES``.
        rows: rows multiplied.
        layers: copies of the layer's weights.
        rounds: interleaved rounds timed.

    Returns:
        ``{"BLAS": s, "oneDNN": s, "prepacked": s, "flop": n}``.
    """
    spec = SHAPES[shape]
    weights = [torch.randn(n_out, n_in) * 0.02 for _ in range(layers) for n_in, n_out in spec["layer"]]
    weights.append(torch.randn(spec["head"][1], spec["head"][0]) * 0.02)
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    layers_of = {id(w): prepacked(w) for w in weights}
    kernels: dict[str, Callable] = {"BLAS": F.linear, "oneDNN": onednn_linear,
                                    "prepacked": lambda x, w: layers_of[id(w)](x)}
    head, x = weights[-1], inputs[weights[-1].shape[1]]
    for kernel in kernels.values():  # warm-up, and the three agree
        torch.testing.assert_close(kernel(x, head), F.linear(x, head), rtol=1e-4, atol=1e-4)
    best = dict.fromkeys(kernels, float("inf"))
    with torch.no_grad():
        for _ in range(rounds):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for w in weights:
                    kernel(inputs[w.shape[1]], w)
                best[name] = min(best[name], time.perf_counter() - start)
    return {**best, "flop": 2.0 * rows * sum(w.numel() for w in weights)}


def prepacked(weight: torch.Tensor) -> PrepackedLinear:
    """A ``PrepackedLinear`` of ``weight`` (no bias)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return PrepackedLinear(linear)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "qwen3"], choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--layers", type=int, default=6, help="copies of a layer's weights per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round")
    args = parser.parse_args(argv)
    for flag in ("rows", "layers", "rounds", "threads"):
        values = getattr(args, flag)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            parser.error(f"--{flag} must be positive integers, got {values}")
    if args.quick:
        args.shapes, args.rows, args.layers, args.rounds = ["tiny"], [2, 4], 2, 1
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, oneDNN built in: "
          f"{torch.backends.mkldnn.is_available()}")
    report = []
    table = Table(f"A decoding step's products, {args.layers} layers and the head, best of {args.rounds} rounds",
                  ["shape", "rows", "BLAS GFLOP/s", "oneDNN GFLOP/s", "prepacked GFLOP/s", "oneDNN vs BLAS",
                   "prepacked vs BLAS", "prepacked vs oneDNN"])
    for shape in args.shapes:
        for rows in args.rows:
            got = measure(shape, rows, args.layers, args.rounds)
            report.append(dict(shape=shape, rows=rows, **got))
            table.rows.append([shape, str(rows), *(f"{got['flop'] / got[k] / 1e9:.1f}" for k in KERNELS),
                               f"{got['BLAS'] / got['oneDNN']:.2f}x", f"{got['BLAS'] / got['prepacked']:.2f}x",
                               f"{got['oneDNN'] / got['prepacked']:.2f}x"])
    print(table.render())
    return report


if __name__ == "__main__":
    main()
