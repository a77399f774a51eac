"""The resume checks and the restore, called directly on tiny modules (no Trainer, no files): every difference
is named, and a restore that does not fit changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from training import TrainerConfig, WarmupCosineLR
from training import checkpoint as ckpt
from training.distributed import rng_state
from training.parallel import ParallelLayout
from training.resume import (
    compare_model,
    compare_run,
    restore_state,
    rng_source_rank,
    run_shape,
    trainer_state,
)

ONE_PROCESS = ParallelLayout("ddp", dp_size=1, dp_rank=0, tp_size=1)


def _model(hidden: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, hidden), nn.Linear(hidden, 2))


def _trained(model: nn.Module) -> tuple[torch.optim.Optimizer, WarmupCosineLR]:
    """An AdamW (and its schedule) that has taken one step, so it holds moments and a step count."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = WarmupCosineLR(optimizer, warmup=2, total=6)
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def _run(dataset_size: int = 10, **config) -> dict:
    return run_shape(TrainerConfig(max_steps=6, batch_size=4, **config), ONE_PROCESS, world_size=1,
                     dataset_size=dataset_size)


def _state(model: nn.Module, optimizer, scheduler, run: dict | None = None) -> dict:
    return trainer_state(model, optimizer, scheduler, run=run or _run(), position=(1, 0, 1),
                         history=[{"step": 1, "loss": 1.0}], eval_history=[],
                         config=TrainerConfig(max_steps=6, batch_size=4))


def _shapes(model: nn.Module, optimizer) -> dict:
    """What the sharded checkpoint's index would say: ``key -> (shape, dtype)``."""
    return {k: (v.shape, v.dtype) for k, v in ckpt.sharded_state(model, optimizer).items()}


def test_the_same_run_and_model_fit() -> None:
    model = _model()
    optimizer, scheduler = _trained(model)
    state = _state(model, optimizer, scheduler)
    assert compare_run(state, _run(), optimizer, scheduler) == []
    assert compare_model(state, _shapes(model, optimizer), model, optimizer) == []


@pytest.mark.parametrize(("now", "message"), [
    (dict(batch_size=2), "the global batch changed from 4 (batch_size 4 x 1 data-parallel replicas) to 2"),
    (dict(dataset_size=12), "the training set had 10 examples, now 12"),
    (dict(seed=3), "seed changed from 0 to 3"),
    (dict(shuffle=False), "shuffle changed from True to False"),
    (dict(grad_accum_steps=2), "grad_accum_steps changed from 1 to 2"),
])
def test_a_changed_run_shape_is_named(now: dict, message: str) -> None:
    model = _model()
    optimizer, scheduler = _trained(model)
    state = _state(model, optimizer, scheduler)
    dataset_size = now.pop("dataset_size", 10)
    run = run_shape(TrainerConfig(**{"max_steps": 6, "batch_size": 4, **now}), ONE_PROCESS, world_size=1,
                    dataset_size=dataset_size)
    problems = compare_run(state, run, optimizer, scheduler)
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_another_world_size_is_named_unless_allowed() -> None:
    model = _model()
    optimizer, scheduler = _trained(model)
    saved = {**_run(), "world_size": 2}
    state = _state(model, optimizer, scheduler, run=saved)
    [problem] = compare_run(state, _run(), optimizer, scheduler)
    assert "written by 2 process(es), this run has 1: pass allow_world_size_change=True" in problem
    assert compare_run(state, _run(), optimizer, scheduler, allow_world_size_change=True) == []


def test_another_optimizer_or_scheduler_class_is_named() -> None:
    model = _model()
    optimizer, scheduler = _trained(model)
    state = _state(model, optimizer, scheduler)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert compare_run(state, _run(), sgd, None) == [
        "the optimizer was torch.optim.adamw.AdamW, now torch.optim.sgd.SGD",
        "the scheduler was training.schedules.WarmupCosineLR, now None",
    ]


def test_a_parameter_of_another_shape_is_named() -> None:
    saved_model = _model(hidden=4)
    optimizer, scheduler = _trained(saved_model)
    state, shapes = _state(saved_model, optimizer, scheduler), _shapes(saved_model, optimizer)
    wider = _model(hidden=5)
    problems = compare_model(state, shapes, wider, torch.optim.AdamW(wider.parameters()))
    assert problems == ["parameters of another shape (another model): 0.bias [4] vs [5], 0.weight [4, 3] vs [5, 3], "
                        "1.weight [2, 4] vs [2, 5]"]


def test_other_frozen_parameters_and_a_short_sharded_state_are_named() -> None:
    model = _model()
    optimizer, scheduler = _trained(model)
    state, shapes = _state(model, optimizer, scheduler), _shapes(model, optimizer)
    frozen = _model()
    frozen[0].bias.requires_grad_(False)
    trainable = [p for p in frozen.parameters() if p.requires_grad]
    problems = compare_model(state, shapes, frozen, torch.optim.AdamW(trainable))
    assert problems[0].startswith("the trainable parameters differ (another model, or other frozen parameters): "
                                  "not in the checkpoint [], only in the checkpoint ['0.bias']")
    del shapes["model/1.bias"]
    assert compare_model(state, shapes, model, optimizer) == ["the sharded state lacks or mis-shapes ['1.bias']"]


def test_other_parameter_groups_are_named() -> None:
    model = _model()
    optimizer, scheduler = _trained(model)
    state = _state(model, optimizer, scheduler)
    weights, biases = [model[0].weight, model[1].weight], [model[0].bias, model[1].bias]
    grouped = torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}])
    assert compare_model(state, _shapes(model, optimizer), model, grouped) == [
        "the optimizer's parameter groups differ: 1 group(s) of [4] saved, 2 of [2, 2] now"]


@pytest.mark.parametrize(("saved", "layout", "rank", "expected"), [
    (dict(world_size=2, dp_size=2, tp_size=1), ParallelLayout("ddp", 2, 1, 1), 1, 1),  # the same processes
    (dict(world_size=2, dp_size=2, tp_size=1), ParallelLayout("ddp", 4, 3, 1), 3, 1),  # 3 % 2 read slice 1
    (dict(world_size=4, dp_size=2, tp_size=2), ParallelLayout("ddp", 2, 1, 1), 1, 2),  # first of tp group 1
    (dict(world_size=2, dp_size=1, tp_size=2), ParallelLayout("tp", 1, 0, 2), 1, 0),   # tp peers share rank 0's
])
def test_each_process_takes_the_random_state_of_the_process_that_read_its_data(saved, layout, rank, expected) -> None:
    assert rng_source_rank(saved, layout, rank=rank, world_size=layout.dp_size * layout.tp_size) == expected


def _saved_and_fresh() -> tuple[nn.Module, torch.optim.Optimizer, dict, dict, dict, nn.Module, torch.optim.Optimizer,
                                 WarmupCosineLR]:
    saved_model = _model(seed=0)
    optimizer, scheduler = _trained(saved_model)
    state = _state(saved_model, optimizer, scheduler)
    targets = {k: v.detach().clone() for k, v in ckpt.sharded_state(saved_model, optimizer).items()}
    rng = copy.deepcopy(rng_state())
    fresh = _model(seed=1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_scheduler = WarmupCosineLR(fresh_optimizer, warmup=2, total=6)
    return saved_model, optimizer, state, targets, rng, fresh, fresh_optimizer, fresh_scheduler


def test_restore_puts_everything_in_place() -> None:
    saved_model, optimizer, state, targets, rng, fresh, fresh_optimizer, fresh_scheduler = _saved_and_fresh()
    torch.rand(3)  # move the generator on: the restore must bring it back
    restore_state(fresh, fresh_optimizer, fresh_scheduler, state, targets, rng)
    for a, b in zip(saved_model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    moments = [optimizer.state_dict()["state"][0]["exp_avg"], fresh_optimizer.state_dict()["state"][0]["exp_avg"]]
    assert torch.equal(*moments)
    assert fresh_scheduler.last_epoch == 1 and torch.equal(torch.get_rng_state(), rng["torch"])


def _untouched(model: nn.Module, before: list[torch.Tensor], optimizer, scheduler, generator: torch.Tensor) -> bool:
    weights = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return (weights and not optimizer.state and scheduler.last_epoch == 0
            and torch.equal(torch.get_rng_state(), generator))


def test_a_restore_that_does_not_fit_changes_nothing() -> None:
    _, _, state, targets, rng, fresh, fresh_optimizer, fresh_scheduler = _saved_and_fresh()
    before = [p.detach().clone() for p in fresh.parameters()]
    torch.rand(3)
    generator = torch.get_rng_state()

    del targets["model/1.bias"]  # the last parameter: every other one would be copied before it is missed
    with pytest.raises(ValueError, match=r"the read state lacks or mis-shapes the parameters \['1.bias'\]"):
        restore_state(fresh, fresh_optimizer, fresh_scheduler, state, targets, rng)
    assert _untouched(fresh, before, fresh_optimizer, fresh_scheduler, generator)


def test_a_refused_optimizer_state_rolls_the_random_state_back() -> None:
    _, _, state, targets, rng, fresh, fresh_optimizer, fresh_scheduler = _saved_and_fresh()
    before = [p.detach().clone() for p in fresh.parameters()]
    torch.rand(3)
    generator = torch.get_rng_state()
    [group] = state["optimizer"]["param_groups"]  # two saved groups where the optimiser has one: torch refuses
    state["optimizer"]["param_groups"] = [{**group, "params": group["params"][:2]},
                                          {**group, "params": group["params"][2:]}]
    with pytest.raises(ValueError, match="parameter groups"):
        restore_state(fresh, fresh_optimizer, fresh_scheduler, state, targets, rng)
    assert _untouched(fresh, before, fresh_optimizer, fresh_scheduler, generator)
