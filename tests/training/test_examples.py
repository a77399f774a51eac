"""The examples run end to end (at toy sizes, on a small text file), answer --help, and reach the quality the
docs document (docs/getting-started.md, "Examples"): at a reduced budget in the fast tests (the figures they assert
are on that page too), and at the page's own budget in the ``slow`` ones.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ["demo", "generate", "mlm", "translate", "plot_attention", "vit_digits"]
TEXT = [
    "Return the number of items in the container.",
    "Raise a ValueError if the argument is negative.",
    "The default value is None, which means no limit.",
    "Open the file and return a stream; the mode defaults to reading text.",
] * 6


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLES))  # as when a script runs: its folder is on sys.path
    try:
        yield lambda name: importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"{t} Example {i}."}) + "\n" for i, t in enumerate(TEXT)))
    return path


#: Who does what in the templated corpus: the verb follows from the subject (and back), the object is free.
ROLES = {"parser": "reads", "writer": "writes", "server": "serves", "client": "sends", "cache": "stores",
         "queue": "holds"}
OBJECTS = ["file", "socket", "buffer", "record", "string", "list", "table", "stream"]


@pytest.fixture
def templated_corpus(tmp_path) -> Path:
    """400 documents where most words follow from their context, so a model that reads context beats the
    unigram baseline by far; the words themselves are drawn at random (seed 0)."""
    rng = random.Random(0)
    docs = []
    for _ in range(400):
        subject, thing = rng.choice(sorted(ROLES)), rng.choice(OBJECTS)
        verb = ROLES[subject]
        docs.append(f"The {subject} {verb} the {thing}. When the {thing} is empty, the {subject} {verb} nothing.")
    path = tmp_path / "templated.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.mark.parametrize("name", NAMES)
def test_help(example, name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        example(name).main(["--help"])
    assert exit_info.value.code == 0
    assert "--steps" in capsys.readouterr().out


SMALL_LM = ["--steps", "3", "--vocab-size", "300", "--seq-len", "16", "--batch-size", "4", "--d-model", "16",
            "--layers", "1", "--heads", "2", "--no-progress"]


def test_generate_trains_saves_reloads_and_samples(example, corpus, tmp_path, capsys) -> None:
    out = tmp_path / "gpt"
    metrics = example("generate").main(["--data", str(corpus), "--out", str(out), *SMALL_LM, "--max-new-tokens", "4",
                                        "--prompt", "Return the"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    assert metrics["val_perplexity"] > 1.0
    assert ">>> Return the" in capsys.readouterr().out


def test_demo_is_generate_with_its_own_folder_and_resumes_when_run_again(example, corpus, tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    demo = example("demo")
    demo.main(["--data", str(corpus), *SMALL_LM, "--out", str(out), "--max-new-tokens", "2", "--warmup", "2"])
    assert (out / "model.safetensors").is_file() and (out / "checkpoints" / "step-00000003").is_dir()
    # Run again with more steps: the run is extended from its checkpoint (steps 4-5), not started afresh.
    demo.main(["--data", str(corpus), *SMALL_LM, "--steps", "5", "--out", str(out), "--max-new-tokens", "2",
               "--warmup", "2"])
    shown = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoints' / 'step-00000003'} (step 3 of 5)" in shown
    assert "trained steps 4-5 in" in shown and (out / "checkpoints" / "step-00000005").is_dir()


def test_mlm_reports_the_unigram_baseline_and_fills_masks(example, corpus, tmp_path, capsys) -> None:
    metrics = example("mlm").main(["--data", str(corpus), "--out", str(tmp_path / "bert"), *SMALL_LM,
                                   "--whole-word-mask", "--sentence", "Return the [MASK] of items."])
    assert metrics["unigram_loss"] > 0 and metrics["val_loss"] > 0
    out = capsys.readouterr().out
    assert "unigram baseline" in out and "-> " in out


def test_mlm_beats_the_unigram_baseline_by_a_margin(example, templated_corpus, tmp_path, capsys) -> None:
    # Measured (seed 0): validation MLM loss 1.47 nats/token against the unigram baseline 2.90 in 300 steps.
    metrics = example("mlm").main([
        "--data", str(templated_corpus), "--out", str(tmp_path / "bert"), "--steps", "300", "--vocab-size", "200",
        "--seq-len", "32", "--d-model", "32", "--layers", "1", "--heads", "2", "--lr", "3e-3", "--warmup", "20",
        "--no-progress", "--sentence", "The parser [MASK] the file.",
    ])
    assert metrics["unigram_loss"] > 2.5
    assert metrics["val_loss"] < metrics["unigram_loss"] - 1.0
    assert "The parser [MASK] the file." in capsys.readouterr().out


TRANSLATE_FAST = ["--max-len", "6", "--layers", "1", "--heads", "2", "--warmup", "100", "--train-size", "20000",
                  "--test-size", "200", "--no-progress"]


def test_translate_reverse_is_exact_at_a_reduced_budget(example, tmp_path, capsys) -> None:
    # Measured (seed 0, 2 threads): 100.0% exact match on 200 held-out sources of up to 6 symbols after 600 steps on
    # an earlier machine; on this project's machine of 2026-11-27 the same run reaches 97.0% after 600 steps, 99.5%
    # after 700 and 98.5% after 800. The budget sits at the edge of what the task needs, so the reduction order
    # (threads, CPU) matters; 700 steps keeps a margin. One thread (99.5% after 700 steps, the same machine): the
    # xdist worker's own count, so the run does not take the other worker's core (two threads there doubled its time).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        accuracy = example("translate").main(["--steps", "700", "--d-model", "64", "--out", str(tmp_path / "rev"),
                                              *TRANSLATE_FAST])
    finally:
        torch.set_num_threads(threads)
    assert accuracy >= 0.98
    assert "exact match on 200 held-out sources" in capsys.readouterr().out
    assert (tmp_path / "rev" / "config.json").is_file()


def test_translate_copy_is_exact_at_a_reduced_budget(example, tmp_path) -> None:
    # Measured (seed 0): 100.0% exact match on 200 held-out sources of up to 6 symbols after 400 steps.
    accuracy = example("translate").main(["--task", "copy", "--steps", "400", "--d-model", "32",
                                          "--out", str(tmp_path / "copy"), *TRANSLATE_FAST])
    assert accuracy >= 0.98


def test_vit_digits_accuracy_at_a_reduced_budget(example) -> None:
    import sklearn  # noqa: F401  (the example needs it: missing, the test fails)
    # Measured (seed 0): 92.2% test accuracy after 300 steps (the README's 1000 steps: 96.7%).
    assert example("vit_digits").main(["--steps", "300", "--eval-every", "1000"]) >= 0.90


# ---------------------------------------------------------------------------------------------- README budgets
@pytest.mark.slow
@pytest.mark.parametrize("task", ["reverse", "copy"])
def test_translate_readme_figure(example, tmp_path, task: str) -> None:
    # README: 100.0% exact match on 500 held-out inputs with the defaults (2500 steps).
    assert example("translate").main(["--task", task, "--out", str(tmp_path / task), "--no-progress"]) >= 0.99


@pytest.mark.slow
def test_mlm_readme_figure(example, tmp_path) -> None:
    # README: validation MLM loss 4.55 vs the unigram baseline 6.23 on the built-in corpus (WordPiece training is
    # not deterministic, so the figure varies slightly).
    metrics = example("mlm").main(["--out", str(tmp_path / "bert"), "--no-progress"])
    assert metrics["val_loss"] < metrics["unigram_loss"] - 1.4
    assert metrics["val_loss"] < 4.8


@pytest.mark.slow
def test_vit_digits_readme_figure(example) -> None:
    import sklearn  # noqa: F401  (the example needs it: missing, the test fails)
    # README: 96.7% test accuracy with the defaults (1000 steps); measured 95.6-97.2% across torch versions and
    # thread counts (the order of float sums changes the run).
    assert example("vit_digits").main([]) >= 0.95


def test_plot_attention_of_a_saved_model(example, corpus, tmp_path) -> None:
    import matplotlib  # noqa: F401  (the example needs it: missing, the test fails)
    example("generate").main(["--data", str(corpus), "--out", str(tmp_path / "gpt"), *SMALL_LM,
                              "--max-new-tokens", "1"])
    png = example("plot_attention").main(["--model", str(tmp_path / "gpt"), "--text", "Return the items.",
                                          "--out", str(tmp_path / "att.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
