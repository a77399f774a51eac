"""``examples/classify.py --lora`` on a few texts: masked-LM pre-training, LoRA + head training through the Trainer,
the adapter saved in the peft layout with the head as ``modules_to_save``, and peft on transformers giving the zoo
model's logits."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from models import EncoderLMConfig
from tokenization.trainers import train_bpe

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "classify.py"
TEXTS = [("Return the event loop for the current thread and start it.", 0),
         ("Parse an email message from bytes and return the headers.", 1),
         ("Schedule the coroutine on the loop and wait for its result.", 0),
         ("Encode the header value with the charset of the message.", 1),
         ("Cancel the task and every callback waiting on the future.", 0),
         ("Split the address list of the message into its mailboxes.", 1),
         ("Run the loop until the future is done, then close it.", 0),
         ("Write the message as bytes with the policy's line endings.", 1)]


def test_lora_path_trains_saves_and_matches_peft(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("classify_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    tokenizer = train_bpe([t for t, _ in TEXTS], vocab_size=120, template="encoder")
    config = EncoderLMConfig(
        vocab_size=len(tokenizer), d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32, dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, mask_token_id=tokenizer.mask_token_id, head="sequence_classification",
        options={"head": {"num_labels": 2, "id2label": {0: "asyncio", 1: "email"}}},
    )
    args = argparse.Namespace(steps=2, mlm_steps=2, batch_size=4, max_len=32, lr=1e-2, rank=2)
    model = example.lora_classifier(args, config, tokenizer, TEXTS, tmp_path)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == ["bert.pooler.dense", "classifier"] and saved["r"] == 2
    assert {m.rsplit(".", 1)[-1] for m in saved["target_modules"]} == {"query", "key", "value", "dense"}
    assert example.check_with_peft(model, tokenizer, [t for t, _ in TEXTS], tmp_path, 32) < 1e-4
    assert {g["label"] for g in model.classify([t for t, _ in TEXTS])} <= {"asyncio", "email"}
