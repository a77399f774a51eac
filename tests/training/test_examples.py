"""The examples run end to end (at toy sizes, on a small text file) and answer --help."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ["demo", "generate", "mlm", "translate", "plot_attention"]
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


def test_demo_is_generate_with_its_own_folder(example, corpus, tmp_path) -> None:
    out = tmp_path / "demo"
    example("demo").main(["--data", str(corpus), *SMALL_LM, "--out", str(out), "--max-new-tokens", "2"])
    assert (out / "model.safetensors").is_file()


def test_mlm_reports_the_unigram_baseline_and_fills_masks(example, corpus, tmp_path, capsys) -> None:
    metrics = example("mlm").main(["--data", str(corpus), "--out", str(tmp_path / "bert"), *SMALL_LM,
                                   "--whole-word-mask", "--sentence", "Return the [MASK] of items."])
    assert metrics["unigram_loss"] > 0 and metrics["val_loss"] > 0
    out = capsys.readouterr().out
    assert "unigram baseline" in out and "-> " in out


def test_translate_decodes_held_out_sources(example, tmp_path, capsys) -> None:
    accuracy = example("translate").main(["--steps", "3", "--train-size", "200", "--test-size", "5", "--d-model", "16",
                                          "--layers", "1", "--heads", "2", "--out", str(tmp_path / "rev"),
                                          "--no-progress"])
    assert 0.0 <= accuracy <= 1.0
    assert "exact match on 5 held-out sources" in capsys.readouterr().out
    assert (tmp_path / "rev" / "config.json").is_file()


def test_plot_attention_of_a_saved_model(example, corpus, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    example("generate").main(["--data", str(corpus), "--out", str(tmp_path / "gpt"), *SMALL_LM,
                              "--max-new-tokens", "1"])
    png = example("plot_attention").main(["--model", str(tmp_path / "gpt"), "--text", "Return the items.",
                                          "--out", str(tmp_path / "att.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
