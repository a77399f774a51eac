"""Tensor-parallel plans for the zoo's blocks (Megatron-LM, Shoeybi et al. 2019, §3).

Attention is split by heads and the feed-forward network by its hidden units: the projections that fan
out (``q_proj``, ``k_proj``, ``v_proj``, ``up_proj``, ``gate_proj``) are sharded column-wise (each process
holds a slice of the output features), the projections that fan back in (``o_proj``, ``down_proj``)
row-wise (a slice of the input features, with one all-reduce of the partial outputs). Between the two,
every process works on its own heads and hidden units without talking to the others; the residual
stream, norms, embeddings and output head stay whole (replicated) on every process.

Per-head pieces need no sharding: a ``q_norm``/``k_norm`` normalises each head over ``d_head`` and rotary
embeddings rotate each head alone. Per-head attention biases (ALiBi slopes, relative position biases) are
computed for all heads by the model; a pre-hook hands each attention module the slice of its own heads.

Built on ``torch.distributed.tensor.parallel`` (DTensor); the same plan runs on gloo (CPU) and nccl (GPU).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

ATTENTION_COLUMNWISE = ("q_proj", "k_proj", "v_proj")
FFN_COLUMNWISE = ("gate_proj", "up_proj")


def is_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a multi-head attention with the zoo's projection names and head counts.

    Args:
        module: any module.

    Returns:
        True for one a tensor-parallel plan can shard.
    """
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in (*ATTENTION_COLUMNWISE, "o_proj")) and all(
        isinstance(getattr(module, n, None), int) for n in ("n_heads", "n_kv_heads")
    )


def is_feed_forward(module: nn.Module) -> bool:
    """Whether ``module`` is a (gated) feed-forward network with ``up_proj``/``down_proj`` linear maps.

    Args:
        module: any module.

    Returns:
        True for one a tensor-parallel plan can shard.
    """
    return isinstance(getattr(module, "up_proj", None), nn.Linear) and isinstance(
        getattr(module, "down_proj", None), nn.Linear
    )


def tensor_parallel_plan(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """The plan ``parallelize_module`` takes: module path -> column- or row-wise style, for every attention
    and feed-forward block of ``model``.

    Args:
        model: any module containing the zoo's attention and feed-forward blocks.
        tp_size: the number of tensor-parallel processes.

    Returns:
        ``{"layers.0.self_attn.q_proj": ColwiseParallel(), ..., "layers.0.ffn.down_proj": RowwiseParallel()}``.

    Raises:
        ValueError: ``tp_size`` is not a positive integer, the model has no attention or feed-forward block,
            or a block's query heads, key/value heads (GQA) or hidden units are not divisible by ``tp_size``, or
            an attention has sinks or q/k norms over the whole projection (not sharded yet).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if is_attention(module):
            whole = [what for what, present in (
                ("sinks", getattr(module, "sinks", None) is not None),
                ("qk_norm_scope='projection'", getattr(module, "qk_norm_scope", "head") == "projection"),
            ) if present]
            if whole:
                raise ValueError(f"{name or type(module).__name__} has {whole[0]} (a tensor over all heads at once, "
                                 "not sharded by the tensor-parallel plan); it cannot be split across processes yet")
            for heads in ("n_heads", "n_kv_heads"):
                if getattr(module, heads) % tp_size:
                    raise ValueError(
                        f"tensor-parallel size {tp_size} does not divide {heads}={getattr(module, heads)} of "
                        f"{name or type(module).__name__}: every process must hold whole heads "
                        f"(GQA needs n_kv_heads divisible by the tensor-parallel size)"
                    )
            plan.update({prefix + p: ColwiseParallel() for p in ATTENTION_COLUMNWISE})
            plan[prefix + "o_proj"] = RowwiseParallel()
        elif is_feed_forward(module):
            hidden = module.up_proj.out_features
            if hidden % tp_size:
                raise ValueError(
                    f"tensor-parallel size {tp_size} does not divide the feed-forward width d_ff={hidden} of {name}"
                )
            plan.update({prefix + p: ColwiseParallel() for p in FFN_COLUMNWISE if hasattr(module, p)})
            plan[prefix + "down_proj"] = RowwiseParallel()
    if not plan:
        raise ValueError(f"{type(model).__name__} has no attention or feed-forward block to shard")
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model``'s attention and feed-forward blocks over the one-dimensional ``mesh`` in place.

    After sharding each attention module holds ``n_heads / tp`` query and ``n_kv_heads / tp`` key/value
    heads (its ``n_heads``/``n_kv_heads`` say so, since it reshapes by them); inputs and outputs of every
    block stay ordinary replicated tensors, so the rest of the model runs unchanged. Call it before any
    data-parallel sharding and before building the optimiser.

    Args:
        model: the model, on the device type of ``mesh``.
        mesh: a one-dimensional device mesh of the tensor-parallel processes.

    Returns:
        ``model`` (sharded in place).

    Raises:
        ValueError: a mesh that is not one-dimensional, or sizes the mesh does not divide (see
            ``tensor_parallel_plan``).
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"mesh must be a one-dimensional DeviceMesh, got {mesh!r}")
    tp_size, rank = mesh.size(), mesh.get_local_rank()
    plan = tensor_parallel_plan(model, tp_size)  # validates every block before anything changes
    attentions = [m for m in model.modules() if is_attention(m)]
    parallelize_module(model, mesh, plan)
    for attn in attentions:
        attn.register_forward_pre_hook(_HeadSlice(attn.n_heads, rank, tp_size), with_kwargs=True)
        attn.n_heads //= tp_size
        attn.n_kv_heads //= tp_size
    return model


class _HeadSlice:
    """Forward pre-hook: the slice of a per-head ``bias`` ``(B, H, Lq, Lk)`` that belongs to this process's
    heads (a bias broadcast over heads, with size 1 there, passes unchanged)."""

    def __init__(self, n_heads: int, rank: int, tp_size: int) -> None:
        self.n_heads, self.local = n_heads, n_heads // tp_size
        self.start = rank * self.local

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict] | None:
        bias = kwargs.get("bias")
        if isinstance(bias, Tensor) and bias.dim() == 4 and bias.shape[1] == self.n_heads:
            kwargs = {**kwargs, "bias": bias[:, self.start: self.start + self.local]}
            return args, kwargs
        return None
