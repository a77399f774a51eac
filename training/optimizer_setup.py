"""The optimiser and scheduler a ``Trainer`` steps: given built, or built from factories once the model is sharded,
and checked to step the model's trainable parameters only.

A factory (``functools.partial(torch.optim.AdamW, lr=1e-3)``) is the general form: the Trainer shards the model
first and builds the optimiser afterwards over what the process really owns. A built ``Optimizer`` is accepted where
nothing is sharded (one process, DDP); its scheduler must then be built too, over that optimiser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]
SchedulerFactory = Callable[[Optimizer], LRScheduler]


def check_optimizer_arguments(optimizer: Any, scheduler: Any) -> None:
    """Check that the optimiser and scheduler are given in forms that fit together, before anything is built.

    Args:
        optimizer: an ``Optimizer`` or a factory (trainable parameters -> ``Optimizer``).
        scheduler: an ``LRScheduler``, a factory (optimiser -> ``LRScheduler``) or None.

    Raises:
        ValueError: an optimiser that is neither, a built optimiser with a scheduler factory, or a factory
            optimiser with a built scheduler (which would step another optimiser than the one built).
    """
    if not isinstance(optimizer, Optimizer) and not callable(optimizer):
        raise ValueError(f"optimizer must be a factory (trainable parameters -> Optimizer) or an Optimizer, "
                         f"got {type(optimizer).__name__}")
    if isinstance(optimizer, Optimizer) and scheduler is not None and not isinstance(scheduler, LRScheduler):
        raise ValueError("with a built optimizer, pass a built scheduler (or pass factories for both)")
    if not isinstance(optimizer, Optimizer) and isinstance(scheduler, LRScheduler):
        raise ValueError("scheduler was built over another optimizer: pass a factory (optimizer -> scheduler) "
                         "so it wraps the optimizer the Trainer builds")


def check_optimizer(optimizer: Optimizer, model: nn.Module) -> None:
    """Check that ``optimizer`` steps trainable parameters of ``model`` only.

    Args:
        optimizer: the optimiser.
        model: the model it trains.

    Raises:
        ValueError: it holds parameters that are not the model's, or frozen ones (``requires_grad=False``); both
            counts are named.
    """
    own = {id(p): p for p in model.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in own for p in params)
    frozen = sum(id(p) in own and not p.requires_grad for p in params)
    if foreign or frozen:
        raise ValueError(
            f"the optimizer holds {foreign} parameter(s) that are not the model's and {frozen} frozen one(s) "
            f"(requires_grad=False); build it over the model's trainable parameters (or pass a factory)"
        )


def built_optimizer(optimizer: Optimizer | OptimizerFactory, model: nn.Module) -> Optimizer:
    """The optimiser over ``model``'s trainable parameters: ``optimizer`` itself when built, else the factory's.

    Args:
        optimizer: a built ``Optimizer`` (already checked) or a factory called with the trainable parameters.
        model: the model, sharded already where it is to be.

    Returns:
        The optimiser.

    Raises:
        ValueError: the factory returned something else than an ``Optimizer``, or one over other parameters.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    built = optimizer([p for p in model.parameters() if p.requires_grad])
    if not isinstance(built, Optimizer):
        raise ValueError(f"the optimizer factory returned a {type(built).__name__}, not an Optimizer")
    check_optimizer(built, model)
    return built


def built_scheduler(scheduler: LRScheduler | SchedulerFactory | None, optimizer: Optimizer) -> LRScheduler | None:
    """The scheduler over ``optimizer``: ``scheduler`` itself when built, else the factory's, or None.

    Args:
        scheduler: a built ``LRScheduler``, a factory called with the optimiser, or None.
        optimizer: the optimiser the Trainer steps.

    Returns:
        The scheduler, or None without one.

    Raises:
        ValueError: the factory returned something else than an ``LRScheduler``, or the scheduler steps another
            optimiser.
    """
    if scheduler is not None and not isinstance(scheduler, LRScheduler):
        scheduler = scheduler(optimizer)
        if not isinstance(scheduler, LRScheduler):
            raise ValueError(f"the scheduler factory returned a {type(scheduler).__name__}, not an LRScheduler")
    if scheduler is not None and scheduler.optimizer is not optimizer:
        raise ValueError("scheduler steps another optimizer than the one the Trainer uses")
    return scheduler
