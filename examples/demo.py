"""The main job (``make demo``): from text to a trained, saved, reloaded model that generates — no download.

Collects the built-in corpus (the Python standard library's docstrings), trains a byte-level BPE tokenizer and
a small GPT-style DecoderLM on it for a few minutes on a CPU with a progress bar, reports validation
perplexity, saves model and tokenizer to ``runs/demo``, loads them back and prints sampled text. Every option
of ``examples/generate.py`` works here too (``--steps``, ``--out``, ``--prompt`` ...).

It keeps a checkpoint every 200 steps and at the end (``runs/demo/checkpoints``): run it again and it resumes —
after Ctrl-C, from the step it stopped at; after a finished run, with nothing left to train (``--steps 1600``
extends it). ``rm -r runs/demo`` starts afresh.

    make demo
    python examples/demo.py --steps 2000 --out runs/demo-long
"""

from __future__ import annotations

import sys
from pathlib import Path

import generate  # the sibling example: python puts this script's folder on sys.path

from training import list_checkpoints

OUT = "runs/demo"
CHECKPOINT_EVERY = "200"


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
    out = Path(generate.parse_args(["--out", OUT, *argv]).out)
    resume = ["--resume"] if list_checkpoints(out / "checkpoints") else []
    return generate.main(["--out", OUT, "--checkpoint-every", CHECKPOINT_EVERY, *resume, *argv])


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # before or after training (during it, a checkpoint is saved first)
        raise SystemExit("\ninterrupted") from None
