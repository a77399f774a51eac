"""What the NaN check of ``generate`` costs: the same decoding with the check and with it patched out, interleaved.

    python -m benchmarks.nan_check            # GPT-2-shape decoder (6 x 512, vocabulary 8192), eager and compiled
    python -m benchmarks.nan_check --quick    # tiny shapes: checks that the script runs

``generate`` refuses to choose tokens from NaN logits (``models.generation.sampling.has_nan`` and ``nan_rows``,
called by ``models.generation.steps.token_loop``); on the CPU it looks at every step's logits before choosing. The
reference is the same loop with both replaced by functions answering "no NaN", in the same run, on the same model,
interleaved A B A B, medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.compare import QUICK, Shapes, zoo_decoder
from models.generation import sampling, steps


def no_nan_rows(logits: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
    return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)


def no_nan(logits: torch.Tensor) -> bool:
    return False


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(model: torch.nn.Module, batch: int, tokens: int, compile: bool, repeats: int) -> tuple[float, float]:
    """Median seconds per generated token with the check and without it."""
    prompt = torch.randint(4, model.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(0))

    def run() -> object:
        return model.generate(prompt, max_new_tokens=tokens, eos_token_id=None, compile=compile)

    real = steps.nan_rows, steps.has_nan
    run()  # warm-up (and compilation)
    with_check, without = [], []
    try:
        for _ in range(repeats):
            steps.nan_rows, steps.has_nan = real
            with_check.append(timed(run))
            steps.nan_rows, steps.has_nan = no_nan_rows, no_nan
            without.append(timed(run))
    finally:
        steps.nan_rows, steps.has_nan = real
    return statistics.median(with_check) / tokens, statistics.median(without) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    assert steps.nan_rows is sampling.nan_rows and steps.has_nan is sampling.has_nan
    shapes = QUICK if args.quick else Shapes()
    tokens = 8 if args.quick else args.tokens
    torch.manual_seed(0)
    model = zoo_decoder(shapes).eval()
    print(f"decoder {shapes.n_layers} x {shapes.d_model}, vocabulary {shapes.vocab}, {tokens} new tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"{'setting':<22} {'with check ms/token':>20} {'without ms/token':>17} {'ratio':>7}")
    for batch, compile in ((1, False), (8, False), (1, True)):
        a, b = measure(model, batch, tokens, compile, 1 if args.quick else args.repeats)
        name = f"batch {batch}, {'compiled' if compile else 'eager'}"
        print(f"{name:<22} {a * 1e3:>20.3f} {b * 1e3:>17.3f} {a / b:>7.3f}")


if __name__ == "__main__":
    main()
