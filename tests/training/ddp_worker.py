"""Run by ``test_distributed.py`` under ``torchrun``: train a tiny DecoderLM on two CPU processes (gloo) and
write rank 0's losses and weights. ``build`` is shared with the single-process reference in the test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import safetensors.torch
import torch

from models import DecoderLM
from training import CausalLMCollator, Trainer, TrainerConfig, cleanup, init_distributed


def build(batch_size: int, grad_accum_steps: int) -> Trainer:
    """The same model, data and optimiser in every process; only the per-process batch differs."""
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32,
                                  dropout=0.0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 14, (40,), generator=g).tolist()
    data = [[2] + torch.randint(5, 40, (k,), generator=g).tolist() + [3] for k in lengths]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    config = TrainerConfig(max_steps=3, batch_size=batch_size, grad_accum_steps=grad_accum_steps, max_grad_norm=5.0,
                           progress=False, device="cpu")
    return Trainer(model, optimizer, config, data, CausalLMCollator(pad_token_id=0))


def main(out: Path) -> None:
    context = init_distributed("gloo")
    trainer = build(batch_size=2, grad_accum_steps=2)  # 2 processes x 2 examples x 2 micro-batches = 8 per step
    history = trainer.train()
    if context.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps([r["loss"] for r in history]))
        safetensors.torch.save_model(trainer.model, str(out / "model.safetensors"))
    cleanup()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
