"""examples/chat_sft.py: the instruction set it builds is valid SFT / preference data held out by module, and (slow)
the whole run — SFT, DPO and the lm-eval scores — completes at a toy budget."""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path

import pytest

from training.jsonl import read_conversations, read_preferences

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("chat_sft")
    finally:
        sys.path.remove(str(EXAMPLES))


def test_the_instruction_set_is_valid_and_held_out_by_module(example, tmp_path) -> None:
    facts = example.functions(["base64", "textwrap", "fnmatch"])
    assert {f["module"] for f in facts} == {"base64", "textwrap", "fnmatch"}
    assert any(f["name"] == "b64encode" and f["summary"].startswith("Encode") for f in facts)
    train = [f for f in facts if f["module"] != "fnmatch"]
    held = [f for f in facts if f["module"] == "fnmatch"]
    example.write_data(tmp_path, train, held, random.Random(0))
    chats = read_conversations(tmp_path / "sft.jsonl")
    assert len(chats) == len(train)
    pairs = read_preferences(tmp_path / "prefs.jsonl")
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    docs = [json.loads(line) for line in (tmp_path / "stdlib_held_out.jsonl").read_text().splitlines()]
    assert all("fnmatch." in d["prompt"] and len(d["choices"]) == 4 for d in docs)


@pytest.mark.slow
def test_the_whole_run_completes(example, tmp_path) -> None:
    table = example.run(example.parse_args(["--out", str(tmp_path), "--sft-steps", "4", "--dpo-steps", "2",
                                            "--d-model", "32", "--layers", "1", "--vocab-size", "400"]))
    assert set(table) == {"chance", "base", "sft", "sft+dpo"}
