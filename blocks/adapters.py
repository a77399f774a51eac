"""Adapters: small trainable modules added beside a frozen linear layer (kind ``adapter``).

An adapter is a registered module ``adapter(in_features, out_features, **options)`` whose ``forward(x)`` returns
the *change* of the layer's output and whose ``delta_weight()`` returns the same change as a weight, so that it
can be folded into the layer. ``AdaptedLinear`` is the ``nn.Linear`` that carries named adapters and runs the
active one; ``AdaptedQuantizedLinear`` does the same beside a quantized layer (``blocks.quantized``) whose packed
weights stay packed and frozen (QLoRA); ``models.adapters.AdapterMixin`` puts them into a model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .quantized import CHUNK_ELEMENTS, QuantizedLinear
from .registry import register


@register("adapter", "lora")
class LoRA(nn.Module):
    """Low-rank adaptation (Hu et al. 2021, §4.1): ``ΔW = (alpha / r) · B A`` with ``A (r, in)``, ``B (out, r)``.

    ``B`` starts at zero, so an untrained LoRA changes nothing; ``A`` starts as ``nn.Linear``'s
    Kaiming-uniform weight, as ``peft`` does. Dropout (``peft``'s ``lora_dropout``) acts on the input of ``A``.

    Args:
        in_features: input width of the adapted layer.
        out_features: output width of the adapted layer.
        r: rank of the update (>= 1).
        alpha: the scale numerator; the update is multiplied by ``alpha / r``.
        dropout: dropout probability on the adapter's input during training, in ``[0, 1)``.

    Raises:
        ValueError: non-positive sizes or rank, a non-finite ``alpha``, or a dropout outside ``[0, 1)``.

    Shapes: x ``(..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(
        self, in_features: int, out_features: int, r: int = 8, alpha: float = 16.0, dropout: float = 0.0
    ) -> None:
        super().__init__()
        for label, value in (("in_features", in_features), ("out_features", out_features), ("r", r)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoRA {label} must be a positive integer, got {value!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise ValueError(f"LoRA alpha must be a finite number, got {alpha!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
        self.in_features, self.out_features, self.r = in_features, out_features, r
        self.alpha, self.dropout_p = float(alpha), float(dropout)
        self.scaling = self.alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, r))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``A`` as an ``nn.Linear`` weight (Kaiming uniform, a = sqrt(5)), ``B = 0`` (§4.1: ΔW = 0 at the start)."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha:g}"

    def forward(self, x: Tensor) -> Tensor:
        # Two thin matmuls (in -> r -> out) instead of one with the (out, in) product: r is small.
        return F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    def delta_weight(self) -> Tensor:
        """The update as an ``nn.Linear`` weight: ``scaling · B A``.

        Returns:
            The update.

        Shapes: -> ``(out_features, in_features)``.
        """
        return (self.lora_B @ self.lora_A) * self.scaling


class AdaptedLinear(nn.Linear):
    """An ``nn.Linear`` with named adapters: ``y = x Wᵀ + b + adapters[active](x)``.

    It keeps the ``weight`` and ``bias`` *Parameter objects* of the layer it replaces, so parameter names,
    optimiser references and tied weights are unchanged; the adapters live under ``adapters.<name>``. At most
    one adapter runs (``active``); a merged adapter (``merge``) is already inside ``weight`` and is not run again.

    Args:
        base: the layer to adapt.

    Shapes: x ``(..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(self, base: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: the base layer's parameters are reused, not allocated
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.adapters = nn.ModuleDict()
        self.active: str | None = None
        self.merged: str | None = None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, active={self.active!r}, merged={self.merged!r}"

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.active is not None and self.merged is None:
            out = out + self.adapters[self.active](x)
        return out

    def merge(self) -> None:
        """Add the active adapter's ``delta_weight()`` to ``weight`` (a no-op without one or when merged)."""
        if self.active is None or self.merged is not None:
            return
        with torch.no_grad():
            self.weight += self.adapters[self.active].delta_weight().to(self.weight.dtype)
        self.merged = self.active

    def unmerge(self) -> None:
        """Subtract the merged adapter's update from ``weight`` again (exact up to floating-point rounding)."""
        if self.merged is None:
            return
        with torch.no_grad():
            self.weight -= self.adapters[self.merged].delta_weight().to(self.weight.dtype)
        self.merged = None

    def plain(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding this layer's ``weight`` and ``bias`` Parameters (adapters dropped).

        Returns:
            The plain layer.
        """
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        layer.weight = self.weight
        layer.bias = self.bias
        return layer


class _PackedLinear(torch.autograd.Function):
    """``layer.linear(x)`` (no bias) whose backward reads the packed weight: ``grad_x = grad_y · unpack()``,
    ``CHUNK_ELEMENTS`` of the weight unpacked at a time. The forward may run a packed-weight kernel that autograd
    cannot differentiate; nothing is saved for the backward but the layer (the frozen weight needs no input)."""

    @staticmethod
    def forward(x: Tensor, layer: QuantizedLinear) -> Tensor:  # type: ignore[override]
        return layer.linear(x)  # autograd is off in here: the kernel need not be differentiable

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, QuantizedLinear], output: Tensor) -> None:
        ctx.layer = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        layer: QuantizedLinear = ctx.layer
        step = max(1, CHUNK_ELEMENTS // layer.in_features)
        grad_x = None
        for start in range(0, layer.out_features, step):
            piece = grad[:, start:start + step] @ layer.unpack(slice(start, start + step)).to(grad.dtype)
            grad_x = piece if grad_x is None else grad_x + piece
        return grad_x, None


class AdaptedQuantizedLinear(nn.Module):
    """A quantized linear layer with named adapters (QLoRA, Dettmers et al. 2023): ``y = base(x) + adapter(x)``.

    The quantized layer stays as it is under ``base``: packed buffers and a frozen bias, never unpacked as a whole.
    Gradients reach the layer's input through the unpacked weight (``_PackedLinear``), whatever kernel its forward
    runs. Adapters are float32 (their input is cast to their dtype, their output to the layer's). They cannot be
    merged into packed weights (``merge`` raises: the scheme cannot hold ``W + ΔW`` exactly, and rounding it again
    would change the function); after ``model.dequantize()`` the base is a float ``nn.Linear`` and merging works.

    Args:
        base: the quantized layer to adapt.

    Raises:
        ValueError: ``base`` is not a ``QuantizedLinear``.

    Shapes: x ``(..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(self, base: QuantizedLinear) -> None:
        super().__init__()
        if not isinstance(base, QuantizedLinear):
            raise ValueError(f"AdaptedQuantizedLinear needs a QuantizedLinear, got {type(base).__name__}")
        self.base: QuantizedLinear | nn.Linear = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.adapters = nn.ModuleDict()
        self.active: str | None = None
        self.merged: str | None = None

    @property
    def packed(self) -> bool:
        """Whether the base layer is quantized (its weights packed); ``False`` once ``dequantize()`` replaced it."""
        return isinstance(self.base, QuantizedLinear)

    def extra_repr(self) -> str:
        return f"active={self.active!r}, merged={self.merged!r}"

    def _base(self, x: Tensor) -> Tensor:
        base = self.base
        if not (self.packed and torch.is_grad_enabled() and x.requires_grad):
            return base(x)
        if x.shape[-1] != base.in_features:
            raise ValueError(f"{type(base).__name__} expects inputs (..., {base.in_features}), got {tuple(x.shape)}")
        y = _PackedLinear.apply(x.reshape(-1, base.in_features), base)
        if base.bias is not None:
            y = y + base.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], base.out_features)

    def forward(self, x: Tensor) -> Tensor:
        out = self._base(x)
        if self.active is not None and self.merged is None:
            adapter = self.adapters[self.active]
            dtype = next(adapter.parameters()).dtype
            out = out + adapter(x.to(dtype)).to(out.dtype)
        return out

    def merge(self) -> None:
        """Add the active adapter's update to the float base's weight (a no-op without one or when merged).

        Raises:
            ValueError: the base is quantized (see the class docstring).
        """
        if self.active is None or self.merged is not None:
            return
        if self.packed:
            raise ValueError(
                f"cannot merge adapter {self.active!r} into a layer quantized as {self.base.scheme!r}: its packed "
                "weights cannot hold W + ΔW; keep the adapter beside it, or call model.dequantize() first"
            )
        with torch.no_grad():
            self.base.weight += self.adapters[self.active].delta_weight().to(self.base.weight.dtype)
        self.merged = self.active

    def unmerge(self) -> None:
        """Subtract the merged adapter's update from the float base's weight (a no-op when none is merged)."""
        if self.merged is None:
            return
        with torch.no_grad():
            self.base.weight -= self.adapters[self.merged].delta_weight().to(self.base.weight.dtype)
        self.merged = None

    def plain(self) -> nn.Module:
        """The base layer (adapters dropped).

        Returns:
            The packed layer.
        """
        return self.base


#: The layers that carry adapters.
ADAPTED_LAYERS = (AdaptedLinear, AdaptedQuantizedLinear)


def adapter_placement(layer: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where an adapter of ``layer`` lives: its weight's device and dtype for a float linear layer (adapted or
    not); the packed tensors' device and float32 for a quantized one (adapted or not).

    Args:
        layer: the layer an adapter is for.

    Returns:
        ``(device, dtype)``.

    Raises:
        ValueError: ``layer`` is neither a linear nor a quantized linear layer.
    """
    if isinstance(layer, AdaptedQuantizedLinear):
        layer = layer.base
    if isinstance(layer, QuantizedLinear):
        return getattr(layer, layer.state_names[0]).device, torch.float32
    if isinstance(layer, nn.Linear):
        return layer.weight.device, layer.weight.dtype
    raise ValueError(f"adapters go beside nn.Linear or quantized linear layers, got {type(layer).__name__}")


def adapted(layer: nn.Module) -> nn.Module:
    """``layer`` ready to carry adapters: an adapted layer as it is, an ``nn.Linear`` as an ``AdaptedLinear``, a
    quantized layer as an ``AdaptedQuantizedLinear``.

    Args:
        layer: a linear, quantized or adapted layer.

    Returns:
        The adapted layer.

    Raises:
        ValueError: as ``adapter_placement``.
    """
    adapter_placement(layer)
    if isinstance(layer, ADAPTED_LAYERS):
        return layer
    return AdaptedQuantizedLinear(layer) if isinstance(layer, QuantizedLinear) else AdaptedLinear(layer)


def check_exportable(model: nn.Module, action: str, *, allow_merged: bool) -> None:
    """Refuse to write a model whose adapters its weights do not hold.

    ``save_pretrained`` (``allow_merged=False``) writes only the base model's tensors, so any adapter would be lost or
    stored under names no loader reads; an export to ``transformers`` (``allow_merged=True``) computes what the model
    computes when no adapter is active or the active one is merged into the weights.

    Args:
        model: the model about to be written.
        action: what is being done, for the message (``"save_pretrained"`` ...).
        allow_merged: accept an active adapter that is merged into the weights.

    Raises:
        ValueError: naming the adapted module and what to call instead (``merge_and_unload()`` or ``save_adapter()``).
    """
    for name, module in model.named_modules():
        if not isinstance(module, ADAPTED_LAYERS) or not len(module.adapters):
            continue
        if allow_merged and (module.active is None or module.merged is not None):
            continue
        raise ValueError(
            f"cannot {action}: module {name!r} carries adapters {list(module.adapters)} that the weights do not "
            "hold; call model.merge_and_unload() first to bake the active adapter in, or save the adapter alone "
            "with model.save_adapter(folder)"
        )
