"""Adapters: small trainable modules added beside a frozen linear layer (kind ``adapter``).

An adapter is a registered module ``adapter(in_features, out_features, **options)`` whose ``forward(x)`` returns
the *change* of the layer's output and whose ``delta_weight()`` returns the same change as a weight, so that it
can be folded into the layer. ``AdaptedLinear`` is the ``nn.Linear`` that carries named adapters and runs the
active one; ``models.adapters.AdapterMixin`` puts it into a model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
        """The update as an ``nn.Linear`` weight, ``(out_features, in_features)``."""
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
        """A plain ``nn.Linear`` holding this layer's ``weight`` and ``bias`` Parameters (adapters dropped)."""
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        layer.weight = self.weight
        layer.bias = self.bias
        return layer


def check_exportable(model: nn.Module, action: str, *, allow_merged: bool) -> None:
    """Refuse to write a model whose adapters its weights do not hold.

    ``save_pretrained`` (``allow_merged=False``) writes only the base model's tensors, so any adapter would be lost or
    stored under names no loader reads; an export to ``transformers`` (``allow_merged=True``) computes what the model
    computes when no adapter is active or the active one is merged into the weights.

    Raises:
        ValueError: naming the adapted module and what to call instead (``merge_and_unload()`` or ``save_adapter()``).
    """
    for name, module in model.named_modules():
        if not isinstance(module, AdaptedLinear) or not len(module.adapters):
            continue
        if allow_merged and (module.active is None or module.merged is not None):
            continue
        raise ValueError(
            f"cannot {action}: module {name!r} carries adapters {list(module.adapters)} that the weights do not "
            "hold; call model.merge_and_unload() first to bake the active adapter in, or save the adapter alone "
            "with model.save_adapter(folder)"
        )
