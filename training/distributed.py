"""Multi-process training on ``torch.distributed``: set-up from ``torchrun``'s environment, and the few
collectives the Trainer needs. Every helper also works in a single plain process (world size 1).

Launch: ``torchrun --nproc_per_node=N script.py``; the script calls ``init_distributed()`` first.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: ``rank`` of ``world_size``, ``local_rank`` on its machine, its device."""

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
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` over all processes, in place (a no-op in a single process); returns it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Wait for every process (a no-op in a single process)."""
    if is_distributed():
        dist.barrier()


def broadcast_object(obj: object, src: int = 0) -> object:
    """``obj`` as held by process ``src`` (a no-op in a single process)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``DistributedDataParallel(model)`` inside a process group, the model itself otherwise."""
    if not is_distributed():
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def cleanup() -> None:
    """Leave the process group, if any."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
