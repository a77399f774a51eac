"""The GGUF block-format layers' products (``blocks.quantized.ggml``) against ``F.linear`` on float32 and a read probe.

    python -m benchmarks.quantized_kernels                      # SmolLM2-135M's shapes, every format (~5 min)
    python -m benchmarks.quantized_kernels --formats Q4_0 Q8_0 --shapes 576x1536
    python -m benchmarks.quantized_kernels --no-compiled --rows 1
    python -m benchmarks.quantized_kernels --quick              # tiny shapes: checks that the script runs

For each weight shape of SmolLM2-135M (576x576 q/o, 192x576 k/v, 1536x576 up/gate, 576x1536 down, 49152x576 head;
the K-quants' 256-weight blocks fit only the 1536-wide one) one process times, interleaved A B A B (median of
``--steps`` rounds), one thread by default:

- **fp32 F.linear**: ``F.linear(x, weight)`` on the float32 weight (ratio 1), and **fp32 sum probe**:
  ``weight.sum()``, a plain read of the float32 weight's bytes (its GB/s is what a pass over memory reaches here);
- **<format> eager**: the layer's ``linear`` as shipped (chunks decoded in the planes order, BLAS);
- **<format> compiled**: the layer under ``torch.compile`` (inductor, static shapes, no gradients): for at most
  ``MAX_ROWS`` rows the decoding fused into the reduction, otherwise chunks decoded by inductor's kernels and BLAS;
- **Q4_0 via _weight_int4pack_mm_for_cpu** (float32 and bfloat16 inputs): torch's CPU int4 kernel on a copy packed
  once outside the timing, ``w = (q - 8) · d + 0`` (exactly Q4_0's weights); its error against ``F.linear`` on the
  unpacked weight is printed (float32 ~1e-7: exact but scalar; bfloat16 ~3e-3: it rounds the inputs).

Each line gives ms per product and the GB/s of the bytes it reads (the packed tensors; for fp32 the float weight)
for 1 and 16 rows, and the time as a ratio to fp32 ``F.linear`` of the same run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

import blocks
from benchmarks.compare import Table
from benchmarks.quantized_int import timed
from blocks.quantized.ggml import GGMLLinear
from blocks.quantized.ggml_formats import SCHEMES

#: (out, in) of SmolLM2-135M's products.
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
QUICK_SHAPES = [(64, 256), (96, 512)]


def make_layer(ggml_type: str, weight: torch.Tensor) -> GGMLLinear:
    """The weight in ``ggml_type``: quantized by gguf where it can, else random valid blocks of the same scale."""
    cls = blocks.get("quantization", SCHEMES[ggml_type])
    if cls.has_quantizer:
        return cls.from_float(weight)
    out, width = weight.shape
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(out, width // cls.block_size, cls.type_size), dtype=np.uint8)
    start = 0
    for _, size, dtype in cls.fields:
        if dtype == torch.float16:  # scales of the weight's size
            scales = rng.uniform(1e-4, 2e-3, size=raw.shape[:2]).astype(np.float16)
            raw[:, :, start:start + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
        start += size
    return cls.from_blocks(torch.from_numpy(raw.reshape(out, -1)))


def int4pack_variants(layer: GGMLLinear, x: torch.Tensor) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """Q4_0 through torch's CPU int4 kernel: name -> product, and name -> relative error against F.linear."""
    out, width = layer.out_features, layer.in_features
    q = layer.qs.view(out, -1, 1, 16)
    codes = torch.cat([q & 15, q >> 4], dim=2).reshape(out, width).int()
    rows = -(-out // 16) * 16  # the kernel packs output channels in sixteens
    padded = torch.full((rows, width), 8, dtype=torch.int32)
    padded[:out] = codes
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 1)
    pairs = torch.zeros(rows, width // 32, 2)
    pairs[:out, :, 0] = layer.d.float()
    pairs = pairs.transpose(0, 1).contiguous()  # (groups, rows, 2): scale, zero 0
    fns = {
        "Q4_0 via _weight_int4pack_mm f32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, pairs),
        "Q4_0 via _weight_int4pack_mm bf16": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), packed, 32, pairs.bfloat16()),
    }
    expected = F.linear(x.double(), layer.unpack().double())
    errors = {name: float((fn()[:, :out].double() - expected).norm() / expected.norm()) for name, fn in fns.items()}
    return fns, errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=sorted(SCHEMES, key=lambda t: (t[-1] == "K", t)),
                        choices=sorted(SCHEMES))
    parser.add_argument("--shapes", nargs="+", help="OUTxIN, e.g. 576x1536 (default: SmolLM2-135M's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled products")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: checks that the script runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # Every layer compiles its own graph of the one shared forward (one per format, shape and row count).
    torch._dynamo.config.recompile_limit = 1024
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    shapes, steps = (QUICK_SHAPES, 2) if args.quick else (shapes, args.steps)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}")
    for out, width in shapes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        weight = torch.randn(out, width) * 0.02
        layers = {t: make_layer(t, weight) for t in args.formats
                  if width % blocks.get("quantization", SCHEMES[t]).block_size == 0}
        results: dict[str, dict[int, float]] = {}
        nbytes = {"fp32 F.linear": weight.numel() * 4, "fp32 sum probe": weight.numel() * 4}
        notes = []
        for rows in args.rows:
            x = torch.randn(rows, width)
            with torch.no_grad():
                fns: dict[str, Callable[[], object]] = {"fp32 F.linear": lambda x=x, w=weight: F.linear(x, w),
                                                        "fp32 sum probe": weight.sum}
                for t, layer in layers.items():
                    nbytes[f"{t} eager"] = nbytes[f"{t} compiled"] = layer.nbytes()
                    fns[f"{t} eager"] = lambda layer=layer, x=x: layer.linear(x)
                    if not args.no_compiled:
                        compiled = torch.compile(layer.eval(), dynamic=False, fullgraph=True)
                        compiled(x)
                        fns[f"{t} compiled"] = lambda c=compiled, x=x: c(x)
                if "Q4_0" in layers:
                    extra, errors = int4pack_variants(layers["Q4_0"], x)
                    fns.update(extra)
                    for name in extra:
                        nbytes[name] = layers["Q4_0"].nbytes()
                    notes += [f"{name}, {rows} row(s): relative error {e:.1e}" for name, e in errors.items()]
                for name, secs in timed(fns, steps).items():
                    results.setdefault(name, {})[rows] = secs
        table = Table(f"{out}x{width}", ["product", *(f"{r} row(s) ms" for r in args.rows),
                                         *(f"{r} row(s) GB/s" for r in args.rows),
                                         *(f"{r} row(s) / fp32" for r in args.rows)])
        reference = results["fp32 F.linear"]
        for name, by_rows in results.items():
            table.rows.append([name, *(f"{by_rows[r] * 1e3:.3f}" for r in args.rows),
                               *(f"{nbytes[name] / by_rows[r] / 1e9:.1f}" for r in args.rows),
                               *(f"{by_rows[r] / reference[r]:.2f}x" for r in args.rows)])
        table.notes += ["GB/s: bytes read (packed tensors; fp32: the float weight) / time",
                        "ratios: time / fp32 F.linear's time in the same run (lower is faster)", *notes]
        print(table.render(), flush=True)


if __name__ == "__main__":
    main()
