"""LoRA under the Trainer (only the adapter trains and is checkpointed) and the fine-tuning example end to end."""

from __future__ import annotations

import importlib
import json
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from models import DecoderLM
from training import CausalLMCollator, Trainer, TrainerConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOCAB = 40


def rows(n: int = 16, length: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, VOCAB, (n, length), generator=g).tolist()


def adapted_model() -> DecoderLM:
    model = DecoderLM.from_preset("tiny", vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=1, dropout=0.0,
                                  pad_token_id=0)
    model.add_adapter(r=2, target_modules=["q_proj", "v_proj"])
    return model


def trainer(model: DecoderLM, tmp_path: Path, steps: int = 4) -> Trainer:
    config = TrainerConfig(max_steps=steps, batch_size=4, progress=False, checkpoint_dir=str(tmp_path / "ckpt"),
                           checkpoint_every=2, device="cpu")
    return Trainer(model, partial(torch.optim.AdamW, lr=1e-2), config, rows(), CausalLMCollator(pad_token_id=0))


def test_trainer_updates_only_the_adapter_and_resumes_exactly(tmp_path: Path) -> None:
    model = adapted_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    run = trainer(model, tmp_path)
    history = run.train()
    assert {id(p) for group in run.optimizer.param_groups for p in group["params"]} == {
        id(p) for n, p in model.named_parameters() if ".adapters.default." in n}
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(bool(p.abs().sum()) for n, p in model.named_parameters() if n.endswith("lora_B"))

    torch.manual_seed(0)
    resumed = adapted_model()  # the same base (seeded), a fresh adapter: the checkpoint restores the adapter
    with torch.no_grad():
        for (n, p), q in zip(resumed.named_parameters(), model.parameters(), strict=True):
            if n in frozen:
                p.copy_(q)
    again = trainer(resumed, tmp_path)
    again.load_checkpoint(sorted((tmp_path / "ckpt").iterdir())[0])
    later = again.train()
    assert [h["loss"] for h in later[-2:]] == pytest.approx([h["loss"] for h in history[-2:]], abs=1e-6)


@pytest.fixture
def example():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module("finetune_lora")
    finally:
        sys.path.remove(str(EXAMPLES))


def test_example_compares_lora_with_full_finetuning_and_reloads_the_adapter(example, tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.jsonl"
    lines = [f"The server answers request {i} from the client." if i % 2 else f"Return the value of item {i}."
             for i in range(40)]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    figures = example.main(["--data", str(corpus), "--out", str(tmp_path / "run"), "--steps", "3",
                            "--pretrain-steps", "3", "--vocab-size", "300", "--seq-len", "16", "--batch-size", "4",
                            "--d-model", "16", "--layers", "1", "--heads", "2", "--rank", "2", "--no-progress"])
    lora, full = figures["lora"], figures["full"]
    assert lora["trainable"] < full["trainable"] == full["total"]
    assert lora["optimizer_mb"] < full["optimizer_mb"] and lora["grads_mb"] < full["grads_mb"]
    assert figures["reloaded_loss"] == pytest.approx(lora["val_loss"], abs=1e-5)
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert "full fine-tuning" in capsys.readouterr().out


def test_example_help(example, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--help"])
    assert exit_info.value.code == 0
    assert "--steps" in capsys.readouterr().out
