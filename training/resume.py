"""Exact resume: the trainer state a checkpoint holds, the checks that decide whether it fits this run, and
the restore that follows only once every check passed on every process. Every field read from the files is
checked first (``training.state_checks``): a checkpoint that does not fit, or holds one bad value, changes nothing.

Functions over explicit arguments (model, optimiser, scheduler, parallel layout, trainer state), so each
check can be exercised without building a ``Trainer``; the files themselves are ``training.checkpoint``'s.
A check returns the problems it found as sentences (an empty list: it fits); ``restore_checkpoint`` gathers
every process's problems and refuses the checkpoint, naming them all, before anything is changed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from . import checkpoint as ckpt
from .distributed import all_gather_object, is_distributed, rng_state, set_rng_state
from .parallel import ParallelLayout, local_tensor
from .schedules import extend_schedule
from .state_checks import check_optimizer_tensors, check_rng, check_state, compare_optimizer, compare_scheduler

TensorShapes = dict[str, tuple[torch.Size, torch.dtype]]


def qualified_name(obj: object) -> str:
    """``module.QualifiedClassName`` of ``obj``'s class (how checkpoints name the optimiser and scheduler).

    Args:
        obj: any object.

    Returns:
        The qualified name.
    """
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def run_shape(config: Any, layout: ParallelLayout, *, world_size: int, dataset_size: int) -> dict[str, Any]:
    """What a resume must agree with: the processes and how the data is cut.

    Args:
        config: the ``TrainerConfig`` (its ``parallel``, ``batch_size``, ``grad_accum_steps``, ``shuffle``, ``seed``).
        layout: the parallel layout of this run.
        world_size: the number of processes.
        dataset_size: the number of training examples.

    Returns:
        Plain data: ``world_size, parallel, dp_size, tp_size, batch_size, global_batch_size, grad_accum_steps,
        dataset_size, shuffle, seed``.
    """
    return {
        "world_size": world_size, "parallel": config.parallel, "dp_size": layout.dp_size,
        "tp_size": layout.tp_size, "batch_size": config.batch_size,
        "global_batch_size": config.batch_size * layout.dp_size, "grad_accum_steps": config.grad_accum_steps,
        "dataset_size": dataset_size, "shuffle": config.shuffle, "seed": config.seed,
    }


def trainer_state(
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler | None,
    *,
    run: dict[str, Any],
    position: tuple[int, int, int],
    history: list[dict[str, float]],
    eval_history: list[dict[str, float]],
    config: Any,
) -> dict[str, Any]:
    """The checkpoint's ``trainer_state.pt``: everything but the tensors and the random states, as plain data.

    Args:
        model: the model being trained.
        optimizer: its optimizer.
        scheduler: its learning-rate scheduler, or None.
        run: ``run_shape`` of this run.
        position: ``(step, epoch, batch_in_epoch)``: optimiser steps done and micro-batches used in the epoch.
        history: the training records so far.
        eval_history: the evaluation records so far.
        config: the ``TrainerConfig`` (stored as a dict, for the reader).

    Returns:
        The state dict (format ``training.checkpoint.FORMAT_VERSION``), parameters named, never numbered.
    """
    step, epoch, batch_in_epoch = position
    return {
        "format_version": ckpt.FORMAT_VERSION,
        "step": step,
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "run": run,
        "trainable": {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad},
        "optimizer_class": qualified_name(optimizer),
        "optimizer": ckpt.optimizer_skeleton(model, optimizer),
        "scheduler_class": None if scheduler is None else qualified_name(scheduler),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "history": history,
        "eval_history": eval_history,
        "config": dataclasses.asdict(config),
    }


def compare_run(
    state: Mapping[str, Any],
    run: Mapping[str, Any],
    optimizer: Optimizer,
    scheduler: LRScheduler | None,
    *,
    allow_world_size_change: bool = False,
) -> list[str]:
    """What differs between the saved run and this one: processes, data, batches, order, optimiser class.

    Args:
        state: the saved trainer state (``trainer_state``).
        run: ``run_shape`` of this run.
        optimizer: this run's optimizer (compared by class).
        scheduler: this run's scheduler, or None (compared by class).
        allow_world_size_change: accept another number of processes.

    Returns:
        One sentence per difference, saying what it was and what it is now (empty: the run fits).
    """
    saved, now = state["run"], run
    problems = []
    if saved["world_size"] != now["world_size"] and not allow_world_size_change:
        problems.append(
            f"it was written by {saved['world_size']} process(es), this run has {now['world_size']}: pass "
            f"allow_world_size_change=True to resume anyway (the data position carries over; random draws such "
            f"as dropout then differ from an uninterrupted run)"
        )
    if saved["dataset_size"] != now["dataset_size"]:
        problems.append(f"the training set had {saved['dataset_size']} examples, now {now['dataset_size']}: the "
                        f"saved data position would point at other examples")
    if saved["global_batch_size"] != now["global_batch_size"]:
        problems.append(
            f"the global batch changed from {saved['global_batch_size']} (batch_size {saved['batch_size']} x "
            f"{saved['dp_size']} data-parallel replicas) to {now['global_batch_size']} (batch_size "
            f"{now['batch_size']} x {now['dp_size']}): the saved data position counts global batches"
        )
    for key in ("grad_accum_steps", "shuffle", "seed"):
        if saved[key] != now[key]:
            problems.append(f"{key} changed from {saved[key]!r} to {now[key]!r}")
    for kind, name in (("optimizer", qualified_name(optimizer)),
                       ("scheduler", None if scheduler is None else qualified_name(scheduler))):
        if state[f"{kind}_class"] != name:
            problems.append(f"the {kind} was {state[f'{kind}_class']}, now {name}")
    return problems


def compare_model(
    state: Mapping[str, Any], shapes: TensorShapes, model: nn.Module, optimizer: Optimizer
) -> list[str]:
    """What differs between the saved model and optimiser and the live ones.

    Args:
        state: the saved trainer state (``trainer_state``).
        shapes: the sharded checkpoint's ``key -> (global shape, dtype)`` (``training.checkpoint.tensor_shapes``).
        model: the model to restore into (only its trainable parameters count).
        optimizer: the optimiser to restore into.

    Returns:
        One sentence per difference: other trainable parameter names or shapes, tensors the sharded state lacks
        or names wrongly, other optimiser parameter groups (empty: it fits).
    """
    now = {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    saved = state["trainable"]
    problems = []
    missing, extra = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
    if missing or extra:
        problems.append(f"the trainable parameters differ (another model, or other frozen parameters): "
                        f"not in the checkpoint {missing[:5]}, only in the checkpoint {extra[:5]}")
    wrong = [f"{n} {saved[n]} vs {now[n]}" for n in sorted(set(now) & set(saved)) if saved[n] != now[n]]
    if wrong:
        problems.append(f"parameters of another shape (another model): {', '.join(wrong[:5])}")
    stored = [n for n in now if f"model/{n}" not in shapes or list(shapes[f"model/{n}"][0]) != now[n]]
    if stored and not problems:
        problems.append(f"the sharded state lacks or mis-shapes {stored[:5]}")
    strangers = sorted({k[len("optim/"): k.rindex("/")] for k in shapes if k.startswith("optim/")} - set(now))
    if strangers and not problems:
        problems.append(f"the sharded optimizer state names parameters the model lacks: {strangers[:5]}")
    groups = [list(g["params"]) for g in state["optimizer"]["param_groups"]]
    names = ckpt.trainable_names(model)
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if groups != current:
        problems.append(f"the optimizer's parameter groups differ: {len(groups)} group(s) of "
                        f"{[len(g) for g in groups]} saved, {len(current)} of {[len(g) for g in current]} now")
    return problems


def rng_source_rank(saved_run: Mapping[str, Any], layout: ParallelLayout, *, rank: int, world_size: int) -> int:
    """The saved process whose random state this process takes: the one that read the same data slice
    (this data-parallel rank modulo the saved number of replicas, the first of its tensor-parallel group),
    or the process of the same rank when the run has the same plain shape.

    Args:
        saved_run: the saved ``run_shape``.
        layout: this run's parallel layout.
        rank: this process's rank.
        world_size: the number of processes now.

    Returns:
        The saved rank.
    """
    if saved_run["world_size"] == world_size and saved_run["tp_size"] == layout.tp_size == 1:
        return rank
    return (layout.dp_rank % saved_run["dp_size"]) * saved_run["tp_size"]


class CheckpointCheck(NamedTuple):
    """What ``check_checkpoint`` found: the problems, and what was read (None where reading failed)."""

    problems: list[str]
    state: dict[str, Any] | None
    rng: dict[str, Any] | None
    metadata: Any


def check_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler | None,
    layout: ParallelLayout,
    run: Mapping[str, Any],
    *,
    rank: int,
    allow_world_size_change: bool = False,
) -> CheckpointCheck:
    """Read and check this process's part of the checkpoint folder ``path``; nothing is changed.

    Process 0 checks every file against the manifest first (and stops there if any is damaged or unlisted);
    then the trainer state, the sharded index and this process's random state are read and checked field by
    field (``training.state_checks``), and the run, the model, the optimiser's groups and the scheduler compared
    with the live ones (``compare_run``, ``compare_model``, ``compare_optimizer``, ``compare_scheduler``).

    Args:
        path: the checkpoint folder.
        model: the model the checkpoint would be restored into.
        optimizer: the optimizer it would be restored into.
        scheduler: the scheduler it would be restored into, or None.
        layout: this run's parallel layout.
        run: ``run_shape`` of this run.
        rank: this process's rank.
        allow_world_size_change: see ``compare_run``.

    Returns:
        A ``CheckpointCheck``; its ``problems`` name every damaged or missing file and every difference.

    Raises:
        OSError: a file could not be read; ``restore_checkpoint`` reports it.
    """
    problems = ckpt.verify_manifest(path) if rank == 0 else []
    if problems:
        return CheckpointCheck(problems, None, None, None)
    try:
        state = ckpt.load_torch(path / ckpt.STATE_NAME, "trainer state")
        if not isinstance(state, dict) or state.get("format_version") != ckpt.FORMAT_VERSION:
            raise ValueError(f"{path / ckpt.STATE_NAME} is not a trainer state of format {ckpt.FORMAT_VERSION}")
        metadata = ckpt.read_metadata(path / ckpt.SHARDED_DIR)
    except ValueError as err:
        return CheckpointCheck([str(err)], None, None, None)
    problems = [f"{path / ckpt.STATE_NAME}: {problem}" for problem in check_state(state)]
    if problems:
        return CheckpointCheck(problems, None, None, None)
    shapes = ckpt.tensor_shapes(metadata)
    problems = compare_run(state, run, optimizer, scheduler, allow_world_size_change=allow_world_size_change)
    problems += compare_model(state, shapes, model, optimizer) + check_optimizer_tensors(shapes, model)
    fields = compare_optimizer(state, optimizer)
    if scheduler is not None and state["scheduler_class"] == qualified_name(scheduler):
        fields += compare_scheduler(state, scheduler)
    problems += [f"{path / ckpt.STATE_NAME}: {problem}" for problem in fields]
    rng_rank = rng_source_rank(state["run"], layout, rank=rank, world_size=run["world_size"])
    rng_path = path / ckpt.rng_name(rng_rank)
    rng = None
    try:
        rng = ckpt.load_torch(rng_path, f"random state of process {rng_rank}")
        problems += check_rng(rng, rng_state(), str(rng_path))
    except ValueError as err:
        problems.append(str(err))
    return CheckpointCheck(problems, state, rng, metadata)


def load_targets(model: nn.Module, shapes: TensorShapes) -> dict[str, Tensor]:
    """Fresh tensors (sharded like the live ones) for the sharded read to fill, so a failed read changes nothing.

    Args:
        model: the model restored into (its trainable parameters).
        shapes: the sharded checkpoint's ``key -> (global shape, dtype)``; its ``optim/<name>/<field>`` keys
            must name trainable parameters (``compare_model`` checks that).

    Returns:
        ``model/<name>`` for each trainable parameter and every ``optim/...`` key of ``shapes``.

    Shapes: each target has its key's global shape, sharded like the live tensor.
    """
    targets: dict[str, Tensor] = {}
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    for name, p in params.items():
        targets[f"model/{name}"] = torch.empty_like(p.detach())
    for key, (shape, dtype) in shapes.items():
        if not key.startswith("optim/"):
            continue
        p = params[key[len("optim/"): key.rindex("/")]]
        if list(shape) == list(p.shape):  # moments: sharded like their parameter
            targets[key] = torch.empty_like(p.detach(), dtype=dtype)
        else:  # scalars (Adam's step) and other small state: whole on every process
            targets[key] = torch.empty(shape, dtype=dtype, device=local_tensor(p).device)
    return targets


def restore_state(
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler | None,
    state: Mapping[str, Any],
    targets: Mapping[str, Tensor],
    rng: Mapping[str, Any],
) -> None:
    """Put the read tensors, the optimiser and scheduler state and the random state in place — all of it or,
    if any part does not fit, none of it.

    Args:
        model: receives ``targets["model/<name>"]`` into each trainable parameter.
        optimizer: receives the saved parameter groups and ``optim/<name>/<field>`` tensors.
        scheduler: receives ``state["scheduler"]`` (if there is a scheduler).
        state: the saved trainer state, already checked (``compare_run``, ``compare_model``).
        targets: the tensors read from the sharded checkpoint (``load_targets``).
        rng: this process's saved random state (``training.distributed.rng_state``).

    Raises:
        ValueError: a target missing or of another shape, optimiser state naming a parameter of no group,
            parameter groups the optimiser does not have, or a scheduler or random state that does not load; the
            model, optimiser, scheduler and random state are then as they were.

    Shapes: each target as its parameter (sharded alike).
    """
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    wrong = [n for n, p in params.items() if f"model/{n}" not in targets or targets[f"model/{n}"].shape != p.shape]
    if wrong:
        raise ValueError(f"the read state lacks or mis-shapes the parameters {wrong[:5]}")
    index = {name: i for i, name in enumerate(n for g in state["optimizer"]["param_groups"] for n in g["params"])}
    per_param: dict[int, dict[str, Any]] = {}
    fields = [(key[len("optim/"): key.rindex("/")], {key[key.rindex("/") + 1:]: value})
              for key, value in targets.items() if key.startswith("optim/")]
    unknown = sorted(({name for name, _ in fields} | set(state["optimizer"]["extra"])) - set(index))
    if unknown:
        raise ValueError(f"the optimizer state names parameters of no parameter group: {unknown[:5]}")
    for name, field in [*fields, *state["optimizer"]["extra"].items()]:
        per_param.setdefault(index[name], {}).update(field)
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["optimizer"]["param_groups"]]
    if scheduler is not None and not isinstance(state["scheduler"], Mapping):
        raise ValueError(f"the saved scheduler state is a {type(state['scheduler']).__name__}, not a dict")
    previous = (rng_state(), optimizer.state_dict(), None if scheduler is None else scheduler.state_dict())
    try:  # the steps that can still refuse their input: undone together if any of them does
        set_rng_state(rng)
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
        if scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(dict(state["scheduler"])))
            extend_schedule(scheduler, optimizer, previous[2])
    except Exception as err:
        set_rng_state(previous[0])
        optimizer.load_state_dict(previous[1])
        if scheduler is not None:
            scheduler.load_state_dict(previous[2])
        raise ValueError(f"the saved optimizer, scheduler or random state does not load: {type(err).__name__}: "
                         f"{err}") from err
    with torch.no_grad():  # shapes checked above: copying cannot fail
        for name, p in params.items():
            p.copy_(targets[f"model/{name}"])


def restore_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler | None,
    layout: ParallelLayout,
    run: Mapping[str, Any],
    *,
    rank: int,
    allow_world_size_change: bool = False,
) -> dict[str, Any]:
    """Check the checkpoint folder ``path`` on every process, then read and restore it (a collective: every
    process calls it).

    Every process's problems are gathered before any collective read starts (else the healthy processes would
    wait forever for a refusing one); with any problem anywhere, nothing is restored.

    Args:
        path: the checkpoint folder.
        model: restored in place (``restore_state``).
        optimizer: restored in place.
        scheduler: restored in place, or None.
        layout: this run's parallel layout.
        run: ``run_shape`` of this run.
        rank: this process's rank.
        allow_world_size_change: see ``compare_run``.

    Returns:
        The saved trainer state, for the caller to take the data position and history from.

    Raises:
        ValueError: every problem found on any process (damaged, missing or unlisted files, a run or model that
            does not fit, a bad field), a failed read of the sharded tensors, or non-finite values in them.
        OSError: a file could not be read on some process (the message names it); nothing was restored.
    """
    io_error = False
    try:
        problems, state, rng, metadata = check_checkpoint(path, model, optimizer, scheduler, layout, run, rank=rank,
                                                          allow_world_size_change=allow_world_size_change)
    except Exception as err:  # reported, never left to hang the other processes
        io_error = isinstance(err, OSError)
        problems, state, rng, metadata = [f"{type(err).__name__}: {err}"], None, None, None
    problems, io_error = _everywhere(problems, io_error)
    if problems:
        error = OSError if io_error else ValueError
        raise error(f"cannot resume from {str(path)!r}:\n  - " + "\n  - ".join(problems))
    assert state is not None and rng is not None and metadata is not None
    targets = load_targets(model, ckpt.tensor_shapes(metadata))
    ckpt.load_sharded(targets, path / ckpt.SHARDED_DIR)  # ValueError or OSError on every process alike
    problems, _ = _everywhere([f"{path / ckpt.SHARDED_DIR} holds non-finite values in {key}" for key, t in
                               targets.items() if t.is_floating_point() and not torch.isfinite(local_tensor(t)).all()])
    if problems:
        raise ValueError(f"cannot resume from {str(path)!r}:\n  - " + "\n  - ".join(problems[:5]))
    restore_state(model, optimizer, scheduler, state, targets, rng)
    return state


def _everywhere(problems: list[str], io_error: bool = False) -> tuple[list[str], bool]:
    """Every process's problems (and whether any was an I/O failure), so that all refuse together."""
    if not is_distributed():
        return problems, io_error
    gathered = all_gather_object((problems, io_error))
    return list(dict.fromkeys(p for ps, _ in gathered for p in ps)), any(io for _, io in gathered)
