"""Extending a run: a finished (or interrupted) run's checkpoint resumed with a larger ``max_steps`` and a
``WarmupCosineLR`` ending there trains on, each later step at the extended cosine's rate; the reference is the same
run made in one process without a checkpoint, its scheduler's ``total`` raised in memory at the same step. A smaller
``total`` is refused. Ctrl-C stops training after a complete step (``TrainingInterrupted``)."""

from __future__ import annotations

import functools
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from models import DecoderLM
from training import CausalLMCollator, Trainer, TrainerConfig, TrainingInterrupted, WarmupCosineLR, warmup_cosine_rate

TINY = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32, dropout=0.0)
LR, WARMUP = 1e-2, 2


def _rows(n: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[2] + torch.randint(5, 40, (int(k),), generator=g).tolist() + [3]
            for k in torch.randint(3, 14, (n,), generator=g)]


def _trainer(root: Path, steps: int) -> Trainer:
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", **TINY)
    config = TrainerConfig(max_steps=steps, batch_size=4, progress=False, checkpoint_dir=str(root))
    return Trainer(model, functools.partial(torch.optim.AdamW, lr=LR), config, _rows(),
                   CausalLMCollator(pad_token_id=0),
                   scheduler=lambda opt: WarmupCosineLR(opt, warmup=WARMUP, total=steps))


def test_a_finished_run_extends_to_more_steps_on_the_longer_cosine(tmp_path: Path) -> None:
    first = _trainer(tmp_path / "run", 4)
    first.train()
    saved = first.save_checkpoint()
    longer = _trainer(tmp_path / "run", 7)
    longer.load_checkpoint(saved)
    assert longer.step == 4 and longer.scheduler.total == 7
    history = longer.train()
    # Steps 1-4 at the first run's rates, 5-7 at the rates of the cosine ending at step 7.
    want = [LR * warmup_cosine_rate(s, WARMUP, 4) for s in (1, 2, 3, 4)]
    want += [LR * warmup_cosine_rate(s, WARMUP, 7) for s in (5, 6, 7)]
    assert [r["lr"] for r in history] == pytest.approx(want, rel=1e-12)
    # The same run without a checkpoint: trained 4 steps, then its schedule's end moved to 7 in memory.
    alone = _trainer(tmp_path / "alone", 7)
    alone.scheduler.total = 4
    alone.train(until=4)
    alone.scheduler.total = 7
    for group in alone.optimizer.param_groups:
        group["lr"] = LR * warmup_cosine_rate(5, WARMUP, 7)
    alone.train()
    for a, b in zip(alone.model.parameters(), longer.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_shorter_schedule_is_refused(tmp_path: Path) -> None:
    first = _trainer(tmp_path, 6)
    first.train(until=2)
    saved = first.save_checkpoint()
    with pytest.raises(ValueError, match=r"the scheduler's total changed from 6 to 4 \(a resume may extend the run, "
                                         r"never shorten it\)"):
        _trainer(tmp_path, 4).load_checkpoint(saved)


def test_ctrl_c_stops_after_a_complete_step(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 50)
    real = trainer._train_step

    def step_then_ctrl_c(batches):  # Ctrl-C arrives in the middle of step 3
        record = real(batches)
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    trainer._train_step = step_then_ctrl_c
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT)  # Python's default, or what another test in this worker left
    with pytest.raises(TrainingInterrupted, match="training interrupted after step 3") as stopped:
        trainer.train()
    assert stopped.value.step == trainer.step == 3 and len(trainer.history) == 3
    assert signal.getsignal(signal.SIGINT) is before  # put back
