"""DPO's frozen reference copy, sharded the way the trained model is.

Under FSDP2 (and tensor parallelism) the model being trained holds only its shard of every parameter; a full
reference copy in each process would undo that saving. ``shard_reference_like`` shards the reference over the
trained model's own device mesh: tensor-parallel blocks over its ``tp`` dimension, then ``fully_shard`` of each
layer and of the root over its ``dp`` dimension — the layout ``training.parallel.apply_parallelism`` gives the
model. The reference computes in float32 (no mixed-precision policy) and is resharded after every forward pass,
so between passes each process holds ``1 / dp_size`` of it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .distributed import unwrap_model
from .parallel import is_dtensor, transformer_layers


def parallel_mesh(model: nn.Module) -> Any | None:
    """The device mesh the (sharded) ``model``'s parameters live on.

    Args:
        model: a model, possibly wrapped for distributed training.

    Returns:
        The ``DeviceMesh`` of its first DTensor parameter, or None when no parameter is a DTensor (one process,
        DDP).
    """
    for param in unwrap_model(model).parameters():
        if is_dtensor(param):
            return param.device_mesh
    return None


def shard_reference_like(reference: nn.Module, model: nn.Module) -> bool:
    """Shard the frozen ``reference`` in place over the mesh of the trained ``model``.

    Args:
        reference: an unsharded copy of the model (parameters frozen), on the model's device.
        model: the model being trained, sharded by ``training.parallel.apply_parallelism`` (or not at all).

    Returns:
        True if ``reference`` was sharded; False if ``model`` is not sharded (nothing to do).

    Raises:
        ValueError: a reference with trainable parameters, or a mesh whose dimensions are not named ``dp`` and/or
            ``tp`` (a model sharded some other way).
    """
    if any(p.requires_grad for p in reference.parameters()):
        raise ValueError("the reference model must be frozen (requires_grad=False) before it is sharded")
    mesh = parallel_mesh(model)
    if mesh is None:
        return False
    names = tuple(mesh.mesh_dim_names or ())
    if not names or not set(names) <= {"dp", "tp"}:
        raise ValueError(f"cannot shard the reference like a model on a mesh with dimensions {names}; "
                         f"expected 'dp' and/or 'tp' (training.parallel.apply_parallelism)")
    if "tp" in names:
        from blocks.parallel import apply_tensor_parallel

        apply_tensor_parallel(reference, mesh["tp"] if len(names) > 1 else mesh)
    if "dp" in names:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["dp"] if len(names) > 1 else mesh
        for layer in transformer_layers(reference):
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(reference, mesh=dp_mesh)
    return True
