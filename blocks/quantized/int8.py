"""``int8``: weight-only int8 with one float32 scale per output channel (symmetric, round to nearest).

``w ≈ scale[o] · q[o, i]`` with ``q`` in [-127, 127]: a quarter of float32's bytes; the error per weight is at
most ``scale / 2 = max|w[o]| / 254``. State: ``weight_int8`` int8 ``(out, in)``, ``scale`` float32 ``(out,)``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register
from ..small_matmul import MAX_ROWS, small_rows_linear
from .base import QuantizedLinear


@register("quantization", "int8")
class Int8Linear(QuantizedLinear):
    """``nn.Linear`` with int8 weights and a float32 scale per output channel.

    Shapes: ``(..., in_features)`` -> ``(..., out_features)``.
    """

    scheme: ClassVar[str] = "int8"
    state_names: ClassVar[tuple[str, ...]] = ("weight_int8", "scale")

    @classmethod
    def packed_shapes(cls, in_features: int, out_features: int, **options: Any) -> dict[str, tuple[tuple, Any]]:
        return {"weight_int8": ((out_features, in_features), torch.int8), "scale": ((out_features,), torch.float32)}

    @classmethod
    def pack(cls, weight: Tensor, **options: Any) -> dict[str, Tensor]:
        # A row of zeros would give scale 0 and 0 / 0 below; any positive scale represents it exactly.
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return {"weight_int8": q, "scale": scale}

    @classmethod
    def decode(cls, packed: dict[str, Tensor], in_features: int, **options: Any) -> Tensor:
        return packed["weight_int8"].float() * packed["scale"].float()[:, None]

    def linear(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.shape[0] <= MAX_ROWS and not torch.is_grad_enabled():
            # Inductor fuses the int8 -> float conversion into the reduction: one pass over the int8 weight.
            return small_rows_linear(x, self.weight_int8, scale=self.scale)
        if x.shape[0] == 1 and x.device.type != "cpu":
            # The GPU kernel for int8 weights × float activations (no float copy of the weight).
            return torch._weight_int8pack_mm(x.contiguous(), self.weight_int8, self.scale.to(x.dtype))
        # On CPU that kernel is slower than a float copy of this one weight and BLAS, even for one row. The scale is
        # per output channel, so it applies after the product.
        return F.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
