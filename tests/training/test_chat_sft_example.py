"""examples/chat_sft.py: the instruction set it builds is valid SFT / preference data held out by module, lm-eval's
requests are encoded as the training rows are, and (slow) the whole run — SFT, DPO and the lm-eval scores —
completes at a toy budget."""

from __future__ import annotations

import importlib
import json
import random
import sys
from pathlib import Path

import pytest

import models
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


def test_lm_eval_requests_start_like_the_training_rows(example, tmp_path) -> None:
    # lm-eval encodes a request's context with the tokenizer's special tokens and scores the answer right after
    # it: both must agree with the chat template's rendering of the training conversation, or the scores measure
    # a format the model never saw (a stray BOS, a space before the answer).
    facts = example.functions(["base64"])
    args = example.parse_args(["--out", str(tmp_path), "--vocab-size", "400", "--d-model", "16", "--layers", "1"])
    tok = models.from_pretrained(example.base_model(tmp_path, facts, args)).tokenizer
    fact = facts[0]
    chat = [{"role": "user", "content": example.question(fact)}, {"role": "assistant", "content": fact["summary"]}]
    context = example.CHATML_PROMPT.format(question=example.question(fact))
    assert tok.apply_chat_template(chat[:1], add_generation_prompt=True) == tok.encode(context)
    whole = tok.apply_chat_template(chat)
    assert whole[: len(tok.encode(context + fact["summary"]))] == tok.encode(context + fact["summary"])
    example.write_data(tmp_path, facts, facts, random.Random(0))
    assert json.loads((tmp_path / "stdlib_seen.yaml").read_text())["target_delimiter"] == ""


@pytest.mark.slow
def test_the_whole_run_completes(example, tmp_path) -> None:
    table = example.run(example.parse_args(["--out", str(tmp_path), "--sft-steps", "4", "--dpo-steps", "2",
                                            "--d-model", "32", "--layers", "1", "--vocab-size", "400"]))
    assert set(table) == {"chance", "base", "sft", "sft+dpo"}
