"""Trainer: exact resume, accumulation = one big batch, clipping, evaluation, checkpoints, progress bar."""

from __future__ import annotations

import pytest
import torch

from models import DecoderLM, EncoderLM
from training import (
    CausalLMCollator,
    MLMCollator,
    Trainer,
    TrainerConfig,
    WarmupCosineLR,
    list_checkpoints,
)

SPECIALS = [0, 1, 2, 3, 4]
TINY = dict(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32)


def _rows(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 14, (n,), generator=g).tolist()
    return [[2] + torch.randint(5, 40, (k,), generator=g).tolist() + [3] for k in lengths]


def _mlm_trainer(tmp_path, seed: int, **overrides) -> Trainer:
    torch.manual_seed(seed)
    model = EncoderLM.from_preset("tiny", **TINY, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = TrainerConfig(**{
        "max_steps": 8, "batch_size": 4, "grad_accum_steps": 2, "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_every": 3, "eval_every": 4, "progress": False, **overrides,
    })
    collator = MLMCollator(pad_token_id=0, mask_token_id=4, vocab_size=40, special_ids=SPECIALS, mlm_probability=0.3)
    data = _rows(30)
    return Trainer(model, opt, config, data, collator, scheduler=WarmupCosineLR(opt, warmup=2, total=8),
                   eval_data=_rows(10, seed=1))


def test_interrupted_and_resumed_run_gives_the_same_losses(tmp_path) -> None:
    # Dropout, MLM masking (global RNG), shuffling across an epoch boundary, accumulation, a scheduler,
    # evaluations: everything a resume must restore.
    straight = _mlm_trainer(tmp_path / "a", seed=0)
    expected = [r["loss"] for r in straight.train()]
    assert len(expected) == 8 and straight.epoch >= 1

    first = _mlm_trainer(tmp_path / "b", seed=0)
    first.train(until=5)  # "killed" after step 5; the last checkpoint is step 3
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "ckpt")] == ["step-00000003"]
    torch.manual_seed(123)  # the new process starts from another RNG state and another initialisation
    resumed = _mlm_trainer(tmp_path / "b", seed=7)
    resumed.load_checkpoint("latest")
    assert resumed.step == 3
    got = [r["loss"] for r in resumed.train()]
    assert got == expected
    assert [e["loss"] for e in resumed.eval_history] == [e["loss"] for e in straight.eval_history]
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _causal_trainer(batch_size: int, accum: int, **overrides) -> Trainer:
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", **TINY, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    config = TrainerConfig(**{"max_steps": 3, "batch_size": batch_size, "grad_accum_steps": accum,
                              "progress": False, "max_grad_norm": None, **overrides})
    return Trainer(model, opt, config, _rows(24), CausalLMCollator(pad_token_id=0))


def test_gradient_accumulation_equals_one_big_batch() -> None:
    big = _causal_trainer(batch_size=4, accum=1)
    small = _causal_trainer(batch_size=2, accum=2)
    big_losses = [r["loss"] for r in big.train()]
    small_losses = [r["loss"] for r in small.train()]
    # Rows have different lengths: a per-micro-batch mean would weigh tokens unequally and differ.
    assert small_losses == pytest.approx(big_losses, rel=1e-5)
    for a, b in zip(big.model.parameters(), small.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert big.history[0]["tokens"] == small.history[0]["tokens"]


def test_gradient_clipping_bounds_the_update() -> None:
    trainer = _causal_trainer(batch_size=4, accum=1, max_grad_norm=1e-4)
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    trainer.train(until=1)
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert 0 < (after - before).norm() <= 0.5 * 1e-4 * 1.001  # SGD lr 0.5 times a gradient of norm <= 1e-4


def test_evaluation_reports_mean_token_loss_and_perplexity(tmp_path) -> None:
    trainer = _mlm_trainer(tmp_path, seed=0, eval_every=None, checkpoint_every=None)
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first == second  # evaluation randomness is seeded and does not touch the training RNG
    assert first["perplexity"] == pytest.approx(torch.tensor(first["loss"]).exp().item())
    assert abs(first["loss"] - torch.log(torch.tensor(40.0)).item()) < 0.5  # an untrained model is near uniform
    trainer.train()
    assert len(trainer.eval_history) == 1 and trainer.eval_history[0]["step"] == 8  # at the end only
    assert trainer.eval_history[0]["loss"] != first["loss"]


def test_checkpoint_folder_contents_and_pruning(tmp_path) -> None:
    trainer = _mlm_trainer(tmp_path, seed=0, checkpoint_every=2, keep_checkpoints=2, eval_every=None)
    trainer.train()
    folders = list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in folders] == ["step-00000006", "step-00000008"]
    assert sorted(f.name for f in folders[-1].iterdir()) == ["manifest.json", "rng-rank0.pt", "sharded",
                                                              "trainer_state.pt"]
    assert sorted(f.name for f in (folders[-1] / "sharded").iterdir()) == [".metadata", "__0_0.distcp"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")] == []
    state = torch.load(folders[-1] / "trainer_state.pt", weights_only=True)
    assert state["step"] == 8 and len(state["history"]) == 8


def test_progress_bar_shows_loss_lr_and_tokens_per_second(tmp_path, capsys) -> None:
    trainer = _mlm_trainer(tmp_path, seed=0, progress=True, max_steps=2, eval_every=1, checkpoint_every=None)
    trainer.train()
    out, err = capsys.readouterr()
    assert "loss=" in err and "lr=" in err and "tok_s=" in err
    assert "step 1: eval loss" in out and "perplexity" in out


def test_non_finite_loss_stops_before_the_update() -> None:
    trainer = _causal_trainer(batch_size=4, accum=1)
    with torch.no_grad():
        trainer.model.final_norm.weight.fill_(float("nan"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(FloatingPointError, match="step 1"):
        trainer.train()
    for a, b in zip(before, trainer.model.parameters(), strict=True):
        assert torch.equal(a, b) or (a.isnan() & b.isnan()).any()


def test_bad_configuration_and_checkpoints_are_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
        TrainerConfig(max_steps=0)
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        TrainerConfig(max_steps=1, checkpoint_every=5)
    with pytest.raises(ValueError, match="max_grad_norm"):
        TrainerConfig(max_steps=1, max_grad_norm=0)
    model = DecoderLM.from_preset("tiny", **TINY)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=1),
                TrainerConfig(max_steps=1, batch_size=64), _rows(10), CausalLMCollator(pad_token_id=0))
    with pytest.raises(ValueError, match="1 parameter.s. that are not the model's"):
        Trainer(model, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1),
                TrainerConfig(max_steps=1, batch_size=4), _rows(10), CausalLMCollator(pad_token_id=0))
    trainer = _causal_trainer(batch_size=4, accum=1)
    with pytest.raises(ValueError, match="until"):
        trainer.train(until=99)
    with pytest.raises(ValueError, match="no eval_data"):
        trainer.evaluate()
    with pytest.raises(ValueError, match="no checkpoint directory"):
        trainer.save_checkpoint()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        trainer.load_checkpoint()
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        trainer.load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="manifest.json is missing"):
        trainer.load_checkpoint(tmp_path / "empty")
