"""Optimiser and learning-rate schedules of *Attention Is All You Need* §5.3, plus warmup-cosine.

The paper trains with Adam (β1 = 0.9, β2 = 0.98, ε = 1e-9) and sets the rate at step ``s`` to
``d_model^-0.5 · min(s^-0.5, s · warmup^-1.5)`` with ``warmup = 4000``: linear warmup, then inverse
square-root decay, peaking at ``s = warmup``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim import Adam, Optimizer
from torch.optim.lr_scheduler import LRScheduler

PAPER_BETAS = (0.9, 0.98)
PAPER_EPS = 1e-9


def noam_rate(step: int, d_model: int, warmup: int = 4000, factor: float = 1.0) -> float:
    """The paper's learning rate at optimiser step ``step`` (counted from 1).

    Args:
        step: the step number, >= 1.
        d_model: model width.
        warmup: warmup steps (the paper: 4000).
        factor: a multiplier (the paper: 1).

    Returns:
        ``factor · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)``.

    Raises:
        ValueError: a step, width or warmup below 1, or a factor <= 0.
    """
    for name, value in (("step", step), ("d_model", d_model), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor!r}")
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


class NoamLR(LRScheduler):
    """The paper's schedule (``noam_rate``) as a torch scheduler.

    The rate is set outright — the optimiser's own ``lr`` is ignored — and ``scheduler.step()`` after each
    ``optimizer.step()`` moves to the next step; the first optimiser step runs at step 1.

    Args:
        optimizer: the optimiser whose groups get the rate.
        d_model: as ``noam_rate``.
        warmup: as ``noam_rate``.
        factor: as ``noam_rate``.
        last_epoch: for resuming by hand (prefer ``load_state_dict``).
    """

    def __init__(self, optimizer: Optimizer, d_model: int, warmup: int = 4000, factor: float = 1.0,
                 last_epoch: int = -1) -> None:
        noam_rate(1, d_model, warmup, factor)  # validate before touching the optimiser
        self.d_model, self.warmup, self.factor = d_model, warmup, factor
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        rate = noam_rate(self.last_epoch + 1, self.d_model, self.warmup, self.factor)
        return [rate for _ in self.optimizer.param_groups]


def paper_adam(params: Iterable[torch.nn.Parameter] | Iterable[dict], lr: float = 1.0,
               weight_decay: float = 0.0) -> Adam:
    """Adam with the paper's β = (0.9, 0.98) and ε = 1e-9 (§5.3).

    Args:
        params: parameters or parameter groups.
        lr: the initial rate; ``NoamLR`` overwrites it from the first step on.
        weight_decay: L2 penalty (the paper uses none).

    Returns:
        The optimiser.
    """
    return Adam(params, lr=lr, betas=PAPER_BETAS, eps=PAPER_EPS, weight_decay=weight_decay)


def decay_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two optimiser parameter groups: matrices (``dim >= 2``: projections, embeddings) with ``weight_decay``,
    vectors (biases, norm gains) without, as GPT-2/3 training does. Pass the result to an optimiser, e.g.
    ``Trainer(model, lambda params: AdamW(decay_groups(params, 0.1), lr=3e-4), ...)``; sharded parameters keep
    their global ``dim``.

    Args:
        params: the parameters to optimise (the Trainer passes the trainable ones).
        weight_decay: the decay of the matrices.

    Returns:
        The two groups, as ``torch.optim`` takes them.

    Raises:
        ValueError: a negative or non-finite ``weight_decay``.
    """
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not (
        math.isfinite(weight_decay) and weight_decay >= 0
    ):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def warmup_cosine_rate(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Multiplier for linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``.

    Args:
        step: optimiser step, counted from 1.
        warmup: warmup steps (>= 0).
        total: the step at which the decay ends (>= 1); later steps stay at ``min_ratio``.
        min_ratio: the final multiplier, in [0, 1].

    Returns:
        A multiplier of the base learning rate, in [min_ratio, 1] after warmup.

    Raises:
        ValueError: bad step counts or ratio.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"total must be a positive integer, got {total!r}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio!r}")
    if step <= warmup:
        return step / warmup if warmup else 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosineLR(LRScheduler):
    """``warmup_cosine_rate`` times each group's initial ``lr``, as a torch scheduler (GPT-style training).

    A run can be extended: resuming its checkpoint with a larger ``total`` (``--steps``) and the same ``warmup`` and
    ``min_ratio`` is accepted (``extendable``), and the steps from there on follow the cosine that ends at the new
    ``total`` (the rate at the resume step rises from where the old cosine had brought it to the new curve's value;
    a finished run at ``min_ratio`` goes back up, as a cosine restart does). A smaller ``total`` is refused.

    Args:
        optimizer: the optimiser.
        warmup: as ``warmup_cosine_rate``.
        total: as ``warmup_cosine_rate``.
        min_ratio: as ``warmup_cosine_rate``.
    """

    #: settings a resumed run may raise (``training.state_checks.compare_scheduler``): the step the decay ends at.
    extendable = ("total",)

    def __init__(self, optimizer: Optimizer, warmup: int, total: int, min_ratio: float = 0.1,
                 last_epoch: int = -1) -> None:
        warmup_cosine_rate(1, warmup, total, min_ratio)
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        scale = warmup_cosine_rate(self.last_epoch + 1, self.warmup, self.total, self.min_ratio)
        return [base * scale for base in self.base_lrs]


def extend_schedule(scheduler: LRScheduler, optimizer: Optimizer, live: Mapping[str, Any]) -> None:
    """After a saved scheduler state was loaded: put back this run's values of the settings its class names
    ``extendable`` (a run resumed with a larger ``total``), and when one differed, set the optimiser's rates to the
    extended schedule's at the saved step, so the next step already follows it.

    Args:
        scheduler: the scheduler, holding the saved state.
        optimizer: its optimiser, holding the saved rates.
        live: this run's scheduler state before the load (``scheduler.state_dict()``).
    """
    changed = {k: live[k] for k in getattr(type(scheduler), "extendable", ()) if k in live
               and scheduler.state_dict().get(k) != live[k]}
    if not changed:
        return
    for key, value in changed.items():
        setattr(scheduler, key, value)
    rates = scheduler.get_lr()  # the rate of the next step (last_epoch + 1) on the extended schedule
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = list(rates)  # torch's own field (what get_last_lr returns)
