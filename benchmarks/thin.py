"""Compiled decoding of deep, thin models against the weight-read floor (row 7 of ``benchmarks.compare``).

    python -m benchmarks.thin                                    # both shapes, batch 1 and 8 (~6 min on 2 cores)
    python -m benchmarks.thin --shapes smollm2-135m --batches 1  # one shape, one batch
    python -m benchmarks.thin --probe-batches                    # skip the fresh-process compile times
    python -m benchmarks.thin --quick                            # tiny shapes (aot_eager): checks the script runs

Shapes (random weights, fp32, tied heads): SmolLM2-135M (30 layers, d_model 576, 9 query / 3 key-value heads,
FFN 1536, vocabulary 49152) and Qwen3-0.6B (28 layers, d_model 1024, 16 / 8 heads of 128, FFN 3072, vocabulary
151936, q/k norms). For each shape and batch, in one process, interleaved A B A B:

- *step ms*: the time of one compiled decoding step inside ``generate(compile=True)`` (greedy, a 32-token prompt):
  the median interval between the starts of consecutive compiled steps — the cost of a token, token choice and
  loop included, the eager prefill not in it. (Subtracting a one-token call's time from a long call's, as this
  row did first, left the prefill's run-to-run noise in the step: 8 rows × 32 prompt tokens through Qwen3-0.6B
  are ~300 GFLOP of eager prefill against a ~0.1 s step.)
- *floor*: the distinct weight bytes (a tied head counted once; every weight is read once per step, whatever the
  batch) ÷ the read bandwidth measured by ``benchmarks.compare.read_bandwidth`` (a ``sum`` over 512 MiB, best of
  10) interleaved with the steps, best of the run;
- *products alone*: the step's linears and head only (``linears_alone``), compiled as the step is and timed
  on the same weights: the floor the available kernels (inductor's reductions at batch 1, its packed GEMM
  template at batch 8) leave before anything else in the step;
- *compile s*: a fresh process with an empty inductor cache times its first ``generate(compile=True)`` call of
  one new step and subtracts its second call: the first-call compile cost a user pays, for the model and for a
  6-layer model of the same widths (the ratio shows what depth costs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.compare import Table, read_bandwidth
from models import DecoderLM, DecoderLMConfig
from models.generation import compiled

NO_SPECIAL_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, dropout=0.0)

#: name -> DecoderLM config of a real small LLM's shape (random weights).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        **DecoderLM.presets["llama-tiny"], "vocab_size": 49152, "d_model": 576, "n_heads": 9, "n_kv_heads": 3,
        "d_ff": 1536, "n_layers": 30, "norm_eps": 1e-5, "tie_embeddings": True,
        "options": {"positional": {"base": 100000.0}}, **NO_SPECIAL_TOKENS,
    },
    "qwen3-0.6b": {**DecoderLM.presets["qwen3-0.6b"], **NO_SPECIAL_TOKENS},
}
#: --quick: the same families at a tiny size.
QUICK_SIZES = dict(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_ff=128, n_layers=3)
#: The depth the compile time is compared with (the GPT-2-shaped benchmark's).
SHALLOW = 6
#: Targets of the issue: the step ÷ the floor, by batch.
TARGETS = {1: 1.15, 8: 1.3}


def build(shape: str, layers: int | None = None, quick: bool = False, max_len: int = 1024) -> DecoderLM:
    """A randomly initialised ``DecoderLM`` of ``shape`` (``layers`` overrides the depth) in eval mode."""
    config = {**SHAPES[shape], "max_len": max_len}
    if quick:
        config.update(QUICK_SIZES)
    if layers is not None:
        config["n_layers"] = layers
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.from_dict(config)).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters (``parameters()`` yields a tied weight once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def prompt_ids(model: DecoderLM, batch: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g)


def _generate(model: DecoderLM, ids: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new, eos_token_id=None, compile=True)
    return time.perf_counter() - start


class StepClock:
    """Records when each compiled decoding step starts (``CompiledStep.__call__``) while entered."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def __enter__(self) -> StepClock:
        self.original = compiled.CompiledStep.__call__
        clock, original = self, self.original

        def timed_call(step: compiled.CompiledStep, *args: Any, **kwargs: Any) -> Any:
            clock.starts.append(time.perf_counter())
            return original(step, *args, **kwargs)

        compiled.CompiledStep.__call__ = timed_call
        return self

    def __exit__(self, *exc: object) -> None:
        compiled.CompiledStep.__call__ = self.original

    def intervals(self) -> list[float]:
        """Seconds between consecutive step starts."""
        return [b - a for a, b in itertools.pairwise(self.starts)]


def measure_steps(model: DecoderLM, batch: int, prompt: int, new: int, reps: int) -> tuple[float, float, float]:
    """(median seconds per compiled step, best read bandwidth in bytes/s, seconds the first call spent compiling),
    measured interleaved."""
    ids = prompt_ids(model, batch, prompt)
    first = _generate(model, ids, new + 1)  # compiles the step of this bucket
    steps, longs, bandwidths = [], [], []
    for _ in range(reps):
        bandwidths.append(read_bandwidth())
        with StepClock() as clock:
            longs.append(_generate(model, ids, new + 1))
        if len(clock.starts) != new:
            raise RuntimeError(f"expected {new} compiled steps in a call for {new + 1} tokens, got {len(clock.starts)}")
        steps.extend(clock.intervals())
    return statistics.median(steps), max(bandwidths), first - statistics.median(longs)


def linears_alone(model: DecoderLM, h: torch.Tensor) -> torch.Tensor:
    """The products of a decoding step and nothing else: each layer's linears in order, each fed the layer's latest
    output of its input width (else the layer's input), the layer's last output added to the residual, then the
    head. Same weights, same order of reads, no attention, norms or token choice."""
    for layer in model.layers:
        latest: dict[int, torch.Tensor] = {}
        for linear in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
            latest[linear.out_features] = linear(latest.get(linear.in_features, h))
        h = h + latest[h.shape[-1]]
    return model.lm_head(h)


def measure_linears(model: DecoderLM, batch: int, reps: int) -> float:
    """Median seconds of ``linears_alone`` on ``batch`` rows, compiled as the decoding step is (``compile_step``:
    the 1-row reductions at batch 1, frozen weights and inductor's GEMM template at 2-8 rows)."""
    step = compiled.compile_step(linears_alone, model, torch.device("cpu"), rows=batch)
    h = torch.randn(batch, 1, model.config.d_model)
    with torch.inference_mode():
        step(model, h)  # compiles
        times = []
        for _ in range(max(10, 4 * reps)):
            start = time.perf_counter()
            step(model, h)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def compile_seconds(shape: str, layers: int | None, batch: int, prompt: int, quick: bool) -> float:
    """First-call compile cost in a fresh process with an empty inductor cache (see the module docstring)."""
    spec = dict(shape=shape, layers=layers, batch=batch, prompt=prompt, quick=quick)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="zoo-thin-inductor-")}
    out = subprocess.run([sys.executable, "-m", "benchmarks.thin", "--compile-probe", json.dumps(spec)],
                         capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def compile_probe(spec: dict) -> float:
    """Body of the compile subprocess: first call (compiles one step) minus the second."""
    if spec["quick"]:
        _quick_backend()
    model = build(spec["shape"], spec["layers"], spec["quick"])
    ids = prompt_ids(model, spec["batch"], spec["prompt"])
    first = _generate(model, ids, 2)
    return first - _generate(model, ids, 2)


def _quick_backend() -> None:
    # A smoke run: dynamo captures the same graphs without inductor's C++ build.
    compiled.BACKEND = "aot_eager"


def row_thin(shapes: list[str], batches: list[int], prompt: int, new: int, reps: int, quick: bool,
             probe_batches: list[int]) -> Table:
    """Row 7: every shape and batch, step time against the floor, with compile times."""
    table = Table(f"7. Deep, thin decoders: compiled decoding vs the weight-read floor (greedy, {prompt}-token "
                  f"prompt, {new} steps, random weights)",
                  ["shape", "layers", "batch", "weights MiB", "step ms", "floor ms", "÷ floor", "target",
                   "products alone ms (÷ floor)", "first-call compile s",
                   f"fresh process: compile s / at {SHALLOW} layers / ratio"])
    for shape in shapes:
        model = build(shape, quick=quick)
        n_bytes = weight_bytes(model)
        for batch in batches:
            step, bandwidth, compile_s = measure_steps(model, batch, prompt, new, reps)
            products = measure_linears(model, batch, reps)
            bandwidth = max(bandwidth, read_bandwidth())
            floor = n_bytes / bandwidth
            probed = "-"
            if batch in probe_batches:
                deep = compile_seconds(shape, None, batch, prompt, quick)
                shallow = compile_seconds(shape, SHALLOW, batch, prompt, quick)
                probed = f"{deep:.1f} / {shallow:.1f} / {deep / shallow:.2f}x"
            target = TARGETS.get(batch)
            table.rows.append([shape, str(model.config.n_layers), str(batch), f"{n_bytes / 2**20:.0f}",
                               f"{step * 1e3:.2f}", f"{floor * 1e3:.2f}", f"{step / floor:.2f}x",
                               "-" if target is None else f"≤ {target}x",
                               f"{products * 1e3:.2f} ({products / floor:.2f}x)", f"{compile_s:.1f}", probed])
        del model
    table.notes.append("step ms = median interval between the starts of consecutive compiled steps inside "
                       "generate(compile=True) (graph, token choice and loop; the eager prefill is not in it), over "
                       "all repetitions.")
    table.notes.append("floor = distinct weight bytes (tied head once; read once per step at any batch) ÷ read "
                       "bandwidth (sum over 512 MiB, best of the run, interleaved with the steps).")
    table.notes.append("products alone = the step's linears and head only, chained layer by layer on the same "
                       "weights, compiled as the step is (benchmarks.thin.linears_alone), median of the calls: what "
                       "the available kernels take for the weight reads and products, before attention, norms, "
                       "rotary, cache writes, token choice and the loop.")
    table.notes.append("first-call compile s = this process's first call of the shape and batch − a later call "
                       "(the inductor cache starts empty; earlier rows' kernels are in memory); fresh process = a "
                       "new interpreter and an empty inductor cache, first call − second call, for the model and "
                       f"for {SHALLOW} layers of the same widths.")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="compiled steps timed per call")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    parser.add_argument("--probe-batches", type=int, nargs="*", default=[1],
                        help="batches whose compile time is also measured in fresh processes (none: skip)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, aot_eager: checks the script runs")
    parser.add_argument("--compile-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for value, name in ((args.prompt, "--prompt"), (args.reps, "--reps"), *((b, "--batches") for b in args.batches)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2 (the step is the interval between two), got {args.new_tokens}")
    if args.compile_probe:
        print(compile_probe(json.loads(args.compile_probe)))
        return
    if args.quick:
        _quick_backend()
        args.reps, args.new_tokens, args.batches = 1, 2, [1]
        args.probe_batches = []
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo-thin-inductor-")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32\n", flush=True)
    print(row_thin(args.shapes, args.batches, args.prompt, args.new_tokens, args.reps, args.quick,
                   args.probe_batches).render(), "\n", flush=True)


if __name__ == "__main__":
    main()
