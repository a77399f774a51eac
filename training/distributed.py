"""Multi-process training on ``torch.distributed``: set-up from ``torchrun``'s environment, the few
collectives the Trainer needs, and each process's random state (saved per process in checkpoints, shared
by tensor-parallel peers). Every helper also works in a single plain process (world size 1).

Launch: ``torchrun --nproc_per_node=N script.py``; the script calls ``init_distributed()`` first.
"""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: ``rank`` of ``world_size``, ``local_rank`` on its machine, its device.

    Attributes:
        rank: this process's global rank.
        world_size: the number of processes.
        local_rank: its rank on this machine (its GPU's index).
        device: the device it computes on.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistributedContext:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``); without those variables, return a single-process context.

    Args:
        backend: "gloo" or "nccl"; default nccl when CUDA is available, else gloo.
        timeout_s: how long collectives wait for the other processes.

    Returns:
        The ``DistributedContext``; on CUDA each process gets ``cuda:LOCAL_RANK``.

    Raises:
        ValueError: an unknown backend, or nccl without CUDA.
    """
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    cuda = torch.cuda.is_available()
    if backend == "nccl" and not cuda:
        raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend or ("nccl" if cuda else "gloo"), timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistributedContext(rank=get_rank(), world_size=get_world_size(), local_rank=local_rank, device=device)


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process.

    Returns:
        Whether collectives have other processes to talk to.
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank (0 outside a process group).

    Returns:
        The rank.
    """
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes (1 outside a process group).

    Returns:
        The world size.
    """
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """Whether this is rank 0 (the one that prints, shows progress bars and writes single files).

    Returns:
        True on rank 0 and outside a process group.
    """
    return get_rank() == 0


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` over all processes, in place (a no-op in a single process).

    Args:
        tensor: this process's values.

    Returns:
        ``tensor``, now the sum.

    Shapes: any -> same.
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Wait for every process (a no-op in a single process)."""
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: object, src: int = 0) -> object:
    """``obj`` as held by process ``src`` (a no-op in a single process).

    Args:
        obj: this process's object (only ``src``'s matters).
        src: the rank whose object every process receives.

    Returns:
        ``src``'s object.
    """
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: object) -> list[object]:
    """Every process's ``obj``, in rank order (``[obj]`` in a single process).

    Args:
        obj: this process's object (picklable).

    Returns:
        One object per rank.
    """
    if not is_distributed():
        return [obj]
    gathered: list[object] = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def default_device() -> torch.device:
    """This process's current GPU if there is one, else the CPU.

    Returns:
        The device.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rng_state() -> dict[str, Any]:
    """This process's random state: torch's CPU generator, Python's ``random`` and, where present, every GPU's.

    Returns:
        ``{"torch": Tensor, "python": tuple, "cuda": [Tensor, ...]}`` (``"cuda"`` only with CUDA), plain data
        that ``torch.save`` and ``torch.load(weights_only=True)`` round-trip.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore a random state taken by ``rng_state`` (the GPUs' part only where CUDA is available).

    Args:
        state: what ``rng_state`` returned.

    Raises:
        KeyError, TypeError, RuntimeError: ``state`` is not what ``rng_state`` returns.
    """
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    """``random.setstate`` needs tuples all the way down; a round trip may hand back lists."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``DistributedDataParallel(model)`` inside a process group, the model itself otherwise.

    Args:
        model: the model, already on ``device``.
        device: this process's device.

    Returns:
        The wrapped (or the same) model.
    """
    if not is_distributed():
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (the model itself otherwise).

    Args:
        model: a model, wrapped or not.

    Returns:
        The model.
    """
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def cleanup() -> None:
    """Leave the process group, if any."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
