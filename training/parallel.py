"""Sharded training on ``torch.distributed``: FSDP2, tensor parallelism and both on a 2-D mesh.

``parallel`` picks how the processes share the work:

- ``"ddp"``: every process holds the whole model; gradients are averaged (``DistributedDataParallel``).
- ``"fsdp"``: parameters, gradients and optimiser state are sharded over all processes (FSDP2,
  ``fully_shard``): each layer is one all-gather/reduce-scatter unit, the root holds the rest.
- ``"tp"``: every block's attention heads and feed-forward units are split over all processes
  (``blocks.parallel``); all processes see the same data.
- ``"fsdp+tp"``: a ``(data, tensor)`` mesh of ``world_size / tp_size`` by ``tp_size`` processes: tensor
  parallel inside each row, FSDP across rows.

Everything here also runs in one plain process (world size 1), where sharding is a no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .distributed import get_rank, get_world_size, is_distributed, rng_state, set_rng_state

if TYPE_CHECKING:  # imported when used: torch.distributed.tensor alone takes seconds to import
    from torch.distributed.device_mesh import DeviceMesh

PARALLEL_MODES = ("ddp", "fsdp", "tp", "fsdp+tp")
MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How the processes are arranged: ``dp_size`` data-parallel groups of ``tp_size`` processes each.

    ``dp_rank`` is this process's data-parallel index (which slice of each global batch it reads); processes
    of one tensor-parallel group share it and read the same examples. ``dp_group`` is the process group that
    sums over data-parallel replicas (None: the whole world, or nothing to sum in a single process).

    Attributes:
        mode: one of ``PARALLEL_MODES``.
        dp_size: data-parallel replicas.
        dp_rank: this process's replica.
        tp_size: processes per tensor-parallel group.
        mesh: the device mesh (``"dp"``/``"tp"`` dimensions), or None without sharding.
    """

    mode: str
    dp_size: int
    dp_rank: int
    tp_size: int
    mesh: DeviceMesh | None = None
    dp_group: dist.ProcessGroup | None = None

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors whose every forward pass is a collective over the processes."""
        return self.mesh is not None and self.mode != "ddp"


def parallel_layout(mode: str, world_size: int, tp_size: int | None = None) -> tuple[int, int]:
    """``(dp_size, tp_size)`` for ``mode`` on ``world_size`` processes.

    Args:
        mode: one of ``PARALLEL_MODES``.
        world_size: the number of processes.
        tp_size: tensor-parallel processes per group (``"tp"``: default and only choice ``world_size``;
            ``"fsdp+tp"``: required, must divide ``world_size``; other modes: None or 1).

    Returns:
        ``(dp_size, tp_size)``.

    Raises:
        ValueError: an unknown mode, or a tensor-parallel size that does not fit the mode and world size.
    """
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {mode!r}")
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1):
        raise ValueError(f"tp_size must be a positive integer or None, got {tp_size!r}")
    if mode in ("ddp", "fsdp"):
        if tp_size not in (None, 1):
            raise ValueError(f"tp_size={tp_size} needs parallel='tp' or 'fsdp+tp', got parallel={mode!r}")
        return world_size, 1
    if mode == "tp":
        tp = world_size if tp_size is None else tp_size
        if tp != world_size:
            raise ValueError(
                f"parallel='tp' shards over every process: tp_size must equal the world size {world_size}, got "
                f"{tp_size} (use parallel='fsdp+tp' to combine it with data parallelism)"
            )
        return 1, tp
    if tp_size is None:
        raise ValueError("parallel='fsdp+tp' needs tp_size (the tensor-parallel processes per data-parallel group)")
    if world_size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the world size {world_size}")
    return world_size // tp_size, tp_size


def apply_parallelism(
    model: nn.Module,
    mode: str,
    device: torch.device,
    *,
    tp_size: int | None = None,
    mixed_precision: str | None = None,
    activation_checkpointing: bool = False,
) -> tuple[nn.Module, ParallelLayout]:
    """Shard or wrap ``model`` for ``mode`` (in place for FSDP2 and tensor parallelism).

    The optimiser must be built afterwards, over the parameters the model holds then (sharded DTensors).

    Args:
        model: the model, already on ``device``.
        mode: one of ``PARALLEL_MODES``.
        device: this process's device (its type names the device mesh: "cpu" with gloo, "cuda" with nccl).
        tp_size: see ``parallel_layout``.
        mixed_precision: "bf16" or "fp16": FSDP2 computes with parameters in that dtype and reduces gradients
            in fp32 (the sharded fp32 parameters stay the master copy); needs an FSDP mode.
        activation_checkpointing: recompute each layer's activations in the backward pass instead of keeping
            them (``torch.distributed._composable.checkpoint``, which keeps parameter names).

    Returns:
        ``(module to call in training, layout)``; the module is ``DistributedDataParallel(model)`` for
        ``"ddp"`` in a process group and ``model`` itself otherwise.

    Raises:
        ValueError: bad mode/sizes (see ``parallel_layout`` and ``blocks.parallel.tensor_parallel_plan``),
            mixed precision without FSDP, or a model without ``layers`` for FSDP or activation checkpointing.
    """
    world = get_world_size()
    dp_size, tp = parallel_layout(mode, world, tp_size)
    if mixed_precision is not None:
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision must be one of {sorted(MIXED_PRECISION)} or None, got {mixed_precision!r}"
            )
        if "fsdp" not in mode or not is_distributed():
            raise ValueError(
                f"mixed_precision={mixed_precision!r} is FSDP2's policy: it needs parallel='fsdp' or 'fsdp+tp' in a "
                f"process group of more than one process (got parallel={mode!r}, world size {world})"
            )
    layers = transformer_layers(model) if (activation_checkpointing or ("fsdp" in mode and is_distributed())) else []
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for layer in layers:
            checkpoint(layer)
    if not is_distributed():
        return model, ParallelLayout(mode, 1, 0, 1)
    if mode == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        return ddp, ParallelLayout(mode, world, get_rank(), 1)

    from torch.distributed.device_mesh import init_device_mesh

    from blocks.parallel import apply_tensor_parallel

    if mode == "fsdp+tp":
        mesh = init_device_mesh(device.type, (dp_size, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    elif mode == "tp":
        mesh = tp_mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
        dp_mesh = None
    else:
        mesh = dp_mesh = init_device_mesh(device.type, (dp_size,), mesh_dim_names=("dp",))
        tp_mesh = None
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    if dp_mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        low = MIXED_PRECISION.get(mixed_precision or "")
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)
        for layer in layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    dp_group = dp_mesh.get_group() if dp_mesh is not None else None
    return model, ParallelLayout(mode, dp_size, dp_rank, tp, mesh, dp_group)


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of every ``layers`` stack in ``model`` (the decoder's, the encoder's, the ViT's), in order.

    Args:
        model: a zoo model.

    Returns:
        The layers.

    Raises:
        ValueError: the model has no ``nn.ModuleList`` named ``layers``.
    """
    found = [
        layer for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" for layer in module
    ]
    if not found:
        raise ValueError(f"{type(model).__name__} has no `layers` list to shard or checkpoint layer by layer")
    return found


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scale the gradients so that their global 2-norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does, for any mix of plain and DTensor gradients (FSDP shards,
    tensor-parallel slices and replicated tensors on meshes of different shapes).

    Args:
        parameters: the parameters whose ``.grad`` to clip.
        max_norm: the bound (> 0).

    Returns:
        The total norm before clipping (a plain scalar tensor, the same on every process).

    Shapes: -> ``()``.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not grads:
        return torch.zeros(())
    if not any(is_dtensor(g) for g in grads):  # plain tensors: torch's own (fused) implementation
        return nn.utils.clip_grad_norm_(parameters, max_norm)
    norms = []
    for g in grads:
        norm = torch.linalg.vector_norm(g, 2, dtype=torch.float32)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)  # the norm of the whole tensor
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2)
    coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))  # clip_grad_norm_'s formula, in fp32
    if coef < 1.0:  # (NaN fails the test: a non-finite norm is left for the caller to refuse)
        for g in grads:
            g.mul_(coef)
    return total


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (without importing ``torch.distributed.tensor`` when nothing uses it).

    Args:
        tensor: anything.

    Returns:
        True for a DTensor.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    """This process's part of ``tensor``: a DTensor's local shard, a plain tensor itself.

    Args:
        tensor: a DTensor or a plain tensor.

    Returns:
        The local tensor.

    Shapes: the global shape -> this process's shard's.
    """
    return tensor.to_local() if is_dtensor(tensor) else tensor


def consolidated_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's whole state dict on the CPU, gathered from every process's shards (a collective: every
    process calls it and gets the whole tensors).

    Args:
        model: the model, sharded (FSDP2, tensor parallel) or not.

    Returns:
        ``name -> tensor`` like ``model.state_dict()``; tied weights stay one tensor under each name.

    Shapes: each tensor has its unsharded (global) shape.
    """
    full: dict[str, Tensor] = {}
    gathered: dict[int, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if id(tensor) not in gathered:  # tied weights are gathered once
            whole = tensor.full_tensor() if is_dtensor(tensor) else tensor
            gathered[id(tensor)] = whole.detach().cpu()
        full[name] = gathered[id(tensor)]
    return full


def unsharded_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 swaps in a subclass ``FSDP<Name>``), to build a plain copy from.

    Args:
        model: a model, sharded by FSDP2 or not.

    Returns:
        Its class before sharding.
    """
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def share_rng_in_tensor_parallel_group(layout: ParallelLayout) -> None:
    """Tensor-parallel peers must draw the same random numbers (dropout on the replicated residual stream):
    each takes its group's first process's generator state. A collective over the ``"tp"`` mesh dimension.

    Args:
        layout: a layout with a ``"tp"`` mesh dimension (``tp_size > 1``).
    """
    group = layout.mesh["tp"].get_group()
    box = [rng_state()]
    dist.broadcast_object_list(box, group=group, group_src=0)
    set_rng_state(box[0])


def gradient_sync(wrapped: nn.Module, model: nn.Module, layout: ParallelLayout,
                  last: bool) -> contextlib.AbstractContextManager[None]:
    """Reduce gradients over the data-parallel replicas only in the backward pass of a step's last micro-batch.

    Args:
        wrapped: what ``apply_parallelism`` returned to call (a DDP wrapper or the model).
        model: the model itself (FSDP2 switches its gradient sync on the model).
        layout: the layout ``apply_parallelism`` returned.
        last: whether the coming backward pass is the step's last.

    Returns:
        The context to run the forward and backward pass in (DDP's ``no_sync`` before the last micro-batch).
    """
    if not is_distributed() or layout.dp_size == 1:
        return contextlib.nullcontext()
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if last else wrapped.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 keeps unsharded gradients until then
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def replica_sum(tensor: Tensor, layout: ParallelLayout) -> Tensor:
    """Sum ``tensor`` in place over the data-parallel replicas (not over tensor-parallel peers, which hold the
    same batch); a no-op with one replica.

    Args:
        tensor: this process's values.
        layout: the run's layout.

    Returns:
        ``tensor``, now the sum.

    Shapes: any -> same.
    """
    if is_distributed() and layout.dp_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=layout.dp_group)
    return tensor
