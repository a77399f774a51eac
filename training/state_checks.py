"""The trainer state a checkpoint holds (``trainer_state.pt``, a random state), checked field by field.

A checkpoint comes from a file, so every field restored from it is checked before anything is restored: each
scalar has a type and a range (``step`` an integer >= 0, ``lr`` a finite number >= 0 ...), the run's shape and
the histories are what the Trainer writes, and the optimiser's parameter groups and the scheduler's state have
the keys and value types of the ones this Trainer built (the scheduler's settings — its constructor arguments
and ``base_lrs`` — must be equal). Each function returns its problems as sentences naming the field (an empty
list: it fits); ``training.resume`` refuses the checkpoint with all of them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from .parallel import PARALLEL_MODES

#: What ``training.resume.trainer_state`` writes.
STATE_KEYS = frozenset({"format_version", "step", "epoch", "batch_in_epoch", "run", "trainable", "optimizer_class",
                        "optimizer", "scheduler_class", "scheduler", "history", "eval_history", "config"})
RUN_KEYS = frozenset({"world_size", "parallel", "dp_size", "tp_size", "batch_size", "global_batch_size",
                      "grad_accum_steps", "dataset_size", "shuffle", "seed"})
HISTORY_KEYS = ("step", "loss", "lr", "tokens")
EVAL_KEYS = ("step", "loss", "perplexity")
#: Scheduler state that moves as it steps (everything else it saves is a setting).
SCHEDULER_PROGRESS = frozenset({"last_epoch", "_step_count", "_last_lr", "_is_initial", "_get_lr_called_within_step"})


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: Any, *, finite: bool = True) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or not math.isnan(value) and (not finite or math.isfinite(value))


def check_state(state: Mapping[str, Any]) -> list[str]:
    """The plain-data fields of a trainer state: keys, position, run shape, trainable shapes, histories, and the
    containers of the optimiser and scheduler state (their contents: ``compare_optimizer``, ``compare_scheduler``).

    Args:
        state: the saved trainer state.

    Returns:
        One sentence per bad field, naming it, its value and what was expected.
    """
    missing, unknown = sorted(STATE_KEYS - set(state)), sorted(set(state) - STATE_KEYS)
    if missing or unknown:
        return [f"the trainer state must hold exactly {sorted(STATE_KEYS)}: missing {missing}, unknown {unknown}"]
    problems = [f"{key} must be an integer >= 0, got {_short(state[key])}"
                for key in ("step", "epoch", "batch_in_epoch") if not _is_int(state[key], 0)]
    problems += _check_run(state["run"])
    trainable = state["trainable"]
    if not isinstance(trainable, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(_is_int(d, 0) for d in v) for k, v in trainable.items()):
        problems.append(f"trainable must map parameter names to shapes (lists of integers >= 0), got "
                        f"{_short(trainable)}")
    if not isinstance(state["optimizer_class"], str):
        problems.append(f"optimizer_class must be a class name, got {_short(state['optimizer_class'])}")
    if state["scheduler_class"] is not None and not isinstance(state["scheduler_class"], str):
        problems.append(f"scheduler_class must be a class name or None, got {_short(state['scheduler_class'])}")
    if (state["scheduler"] is None) != (state["scheduler_class"] is None) or not isinstance(
            state["scheduler"], (dict, type(None))):
        problems.append(f"scheduler must be a dict with a scheduler_class (None without), got "
                        f"{_short(state['scheduler'])}")
    problems += _check_optimizer_skeleton(state["optimizer"])
    if not isinstance(state["config"], dict):
        problems.append(f"config must be a dict, got {_short(state['config'])}")
    if not problems:
        run = state["run"]
        per_epoch = run["dataset_size"] // run["global_batch_size"]
        if state["batch_in_epoch"] > per_epoch:
            problems.append(f"batch_in_epoch must be <= {per_epoch} (batches per epoch), got {state['batch_in_epoch']}")
        problems += _check_history(state["history"], state["step"], "history", HISTORY_KEYS)
        problems += _check_history(state["eval_history"], state["step"], "eval_history", EVAL_KEYS)
    return problems


def _check_run(run: Any) -> list[str]:
    if not isinstance(run, dict) or set(run) != RUN_KEYS:
        return [f"run must be a dict of {sorted(RUN_KEYS)}, got {_short(run)}"]
    problems = [f"run.{key} must be an integer >= 1, got {_short(run[key])}" for key in
                ("world_size", "dp_size", "tp_size", "batch_size", "global_batch_size", "grad_accum_steps",
                 "dataset_size") if not _is_int(run[key], 1)]
    if run["parallel"] not in PARALLEL_MODES:
        problems.append(f"run.parallel must be one of {PARALLEL_MODES}, got {_short(run['parallel'])}")
    if not isinstance(run["shuffle"], bool):
        problems.append(f"run.shuffle must be True or False, got {_short(run['shuffle'])}")
    if not _is_int(run["seed"], 0):
        problems.append(f"run.seed must be an integer >= 0, got {_short(run['seed'])}")
    if not problems and (run["global_batch_size"] != run["batch_size"] * run["dp_size"]
                         or run["world_size"] != run["dp_size"] * run["tp_size"]):
        problems.append(f"run is inconsistent: global_batch_size must be batch_size x dp_size and world_size "
                        f"dp_size x tp_size, got {run}")
    return problems


def _check_optimizer_skeleton(skeleton: Any) -> list[str]:
    groups = skeleton.get("param_groups") if isinstance(skeleton, dict) else None
    extra = skeleton.get("extra") if isinstance(skeleton, dict) else None
    if set(skeleton if isinstance(skeleton, dict) else ()) != {"param_groups", "extra"} or not isinstance(
            groups, list) or not isinstance(extra, dict):
        return [f"optimizer must be a dict of param_groups (a list) and extra (a dict), got {_short(skeleton)}"]
    problems = []
    for i, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or not all(isinstance(n, str) for n in params):
            problems.append(f"optimizer.param_groups[{i}] must be a dict whose params is a list of parameter "
                            f"names, got {_short(group)}")
    for name, fields in extra.items():
        if not isinstance(name, str) or not isinstance(fields, dict):
            problems.append(f"optimizer.extra[{name!r}] must be a dict of plain values, got {_short(fields)}")
            continue
        for key, value in fields.items():
            if not (value is None or isinstance(value, (bool, str)) or _is_number(value)):
                problems.append(f"optimizer.extra[{name!r}].{key} must be None, a bool, a string or a finite "
                                f"number, got {_short(value)}")
    return problems


def _check_history(records: Any, step: int, field: str, keys: tuple[str, ...]) -> list[str]:
    """``history`` holds one record per step (its ``step`` 1, 2, ...); ``eval_history`` records of steps <= step."""
    if not isinstance(records, list) or (field == "history" and len(records) != step):
        count = f"{step} records (one per step)" if field == "history" else "records"
        return [f"{field} must be a list of {count}, got {_short(records)}"]
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not set(keys) <= set(record) or not all(isinstance(k, str) for k in record):
            return [f"{field}[{i}] must be a dict with the keys {list(keys)}, got {_short(record)}"]
        bad = [k for k, v in record.items() if not _is_number(v, finite=k not in ("loss", "perplexity"))]
        expected_step = record["step"] == i + 1 if field == "history" else _is_int(record["step"], 0) and record[
            "step"] <= step
        if bad or not expected_step:
            return [f"{field}[{i}].{(bad or ['step'])[0]} is not a number of this run's record, got {_short(record)}"]
    return []


def check_optimizer_tensors(shapes: Mapping[str, tuple[torch.Size, torch.dtype]], model: nn.Module) -> list[str]:
    """The sharded index's ``optim/<name>/<field>`` tensors: each no larger than its parameter (moments are its
    shape, Adam's step a scalar), so reading them cannot allocate more than the model holds.

    Args:
        shapes: tensor name -> (shape, dtype), from the checkpoint's index.
        model: the model being restored.

    Returns:
        One sentence per problem, naming the field, its value and what was expected (empty: none).
    """
    numel = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    problems = []
    for key, (shape, _) in shapes.items():
        name = key[len("optim/"): key.rfind("/")]
        if key.startswith("optim/") and name in numel and math.prod(shape) > max(1, numel[name]):
            problems.append(f"the sharded tensor {key} has the shape {list(shape)}, larger than its parameter")
    return problems


def _like(saved: Any, live: Any, field: str, problems: list[str]) -> None:
    """Append a problem where ``saved`` is not of the kind of ``live`` (numbers: finite where ``live`` is;
    lists and tuples: the same length; dicts: the same keys), recursing over ``live`` only."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        ok = type(saved) is type(live)
    elif isinstance(live, (int, float)):
        ok = _is_number(saved, finite=math.isfinite(live))
    elif isinstance(live, Tensor):
        ok = isinstance(saved, Tensor) and saved.shape == live.shape and saved.dtype == live.dtype
    elif isinstance(live, (list, tuple)):
        ok = isinstance(saved, (list, tuple)) and len(saved) == len(live)
        if ok:
            for i, (s, v) in enumerate(zip(saved, live, strict=True)):
                _like(s, v, f"{field}[{i}]", problems)
    elif isinstance(live, Mapping):
        ok = isinstance(saved, Mapping) and set(saved) == set(live)
        if ok:
            for key, value in live.items():
                _like(saved[key], value, f"{field}.{key}", problems)
    else:
        ok = type(saved) is type(live)
    if not ok:
        expected = f"of type {type(live).__name__}"
        if isinstance(live, (int, float)) and not isinstance(live, bool):
            expected = "a finite number" if math.isfinite(live) else "a number (not NaN)"
        elif isinstance(live, (list, tuple)):
            expected = f"a list of {len(live)} values"
        elif isinstance(live, Mapping):
            expected = f"a dict of the keys {sorted(map(str, live))}"
        problems.append(f"{field} must be {expected} (as this run's), got {_short(saved)}")


def compare_optimizer(state: Mapping[str, Any], optimizer: Optimizer) -> list[str]:
    """The saved parameter groups against this optimiser's: the same keys and value types, learning rates >= 0.

    Args:
        state: the saved trainer state.
        optimizer: this run's optimiser.

    Returns:
        One sentence per problem, naming the field, its value and what was expected (empty: none).
    """
    problems: list[str] = []
    saved = state["optimizer"]["param_groups"]
    for i, (group, live) in enumerate(zip(saved, optimizer.param_groups, strict=False)):
        _like({k: v for k, v in group.items() if k != "params"}, {k: v for k, v in live.items() if k != "params"},
              f"optimizer.param_groups[{i}]", problems)
        for key in ("lr", "initial_lr"):
            if key in group and _is_number(group[key]) and group[key] < 0:
                problems.append(f"optimizer.param_groups[{i}].{key} must be >= 0, got {group[key]!r}")
    return problems


def compare_scheduler(state: Mapping[str, Any], scheduler: LRScheduler | None) -> list[str]:
    """The saved scheduler state against this scheduler's: the same keys and value types, the same settings
    (constructor arguments it keeps, and ``base_lrs``) except a larger value of a setting the scheduler class names
    ``extendable`` (``WarmupCosineLR``'s ``total``: a run extended), ``last_epoch`` >= -1 and learning rates >= 0.

    Args:
        state: the saved trainer state.
        scheduler: this run's scheduler, or None.

    Returns:
        One sentence per problem, naming the field, its value and what was expected (empty: none).
    """
    saved = state["scheduler"]
    if scheduler is None or not isinstance(saved, dict):
        return []
    live = scheduler.state_dict()
    problems: list[str] = []
    _like(saved, live, "scheduler", problems)
    if problems:
        return problems
    arguments = set(inspect.signature(type(scheduler).__init__).parameters) - {"self", "optimizer", "last_epoch"}
    extendable = set(getattr(type(scheduler), "extendable", ()))
    for key in sorted((arguments & set(live)) | ({"base_lrs"} & set(live))):
        if key in extendable and _is_number(saved[key]) and _is_number(live[key]) and saved[key] < live[key]:
            continue  # a longer run: the schedule keeps its shape and ends later (training.resume.restore_state)
        if saved[key] != live[key]:
            grow = " (a resume may extend the run, never shorten it)" if key in extendable else ""
            problems.append(f"the scheduler's {key} changed from {_short(saved[key])} to {_short(live[key])}{grow}")
    if "last_epoch" in saved and saved["last_epoch"] < -1:
        problems.append(f"scheduler.last_epoch must be an integer >= -1, got {saved['last_epoch']!r}")
    if any(_is_number(lr) and lr < 0 for lr in saved.get("_last_lr", [])):
        problems.append(f"scheduler._last_lr must hold learning rates >= 0, got {_short(saved['_last_lr'])}")
    return problems


def check_rng(rng: Any, live: Mapping[str, Any], what: str) -> list[str]:
    """A saved random state against this process's (``training.distributed.rng_state``): the same keys, torch's
    generator state of the same size (Python's is checked by ``random.setstate`` itself, rolled back on failure).

    Args:
        rng: the saved random state.
        live: this process's.
        what: names the state in messages.

    Returns:
        One sentence per problem, naming the field, its value and what was expected (empty: none).
    """
    problems: list[str] = []
    if not isinstance(rng, dict) or not {"torch", "python"} <= set(rng) <= {"torch", "python", "cuda"}:
        return [f"{what} must be a dict of torch, python (and cuda) states, got {_short(rng)}"]
    _like(rng["torch"], live["torch"], f"{what}: torch", problems)
    if not isinstance(rng["python"], (list, tuple)) or len(rng["python"]) != 3:
        problems.append(f"{what}: python must be what random.getstate() returns, got {_short(rng['python'])}")
    return problems
