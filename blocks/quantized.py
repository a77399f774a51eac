"""Weight-only int8 linear layers for decoding: weights read at one byte each.

Decoding one token at a time is bound by reading the weights, so storing them as int8 with one float scale per
output channel (symmetric, ``w ≈ scale[o] · q[o, i]`` with ``q`` in [-127, 127]) reads a quarter of the bytes of
float32. Activations stay in floating point (weight-only quantization, as in LLM.int8's weight storage or
gpt-fast's int8 mode); the error per weight is at most ``scale / 2 = max|w[o]| / 254``.

``torchao`` is not installed with this torch (2.13, CPU), so the layer is implemented here. Registered as
``blocks.get("quantization", "int8")``; ``quantize_linears(module, "int8")`` swaps every ``nn.Linear`` in place.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .registry import get, names, register

#: Rows (batch × tokens) up to which a compiled graph uses the fused dequantize-multiply-reduce form.
_FUSED_ROWS = 16


@register("quantization", "int8")
class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and a float32 scale per output channel.

    Args:
        in_features, out_features: as ``nn.Linear``.
        bias: whether there is a (float) bias.

    Shapes: ``(..., in_features)`` -> ``(..., out_features)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize ``linear``'s weight per output channel (symmetric, round to nearest).

        Raises:
            ValueError: ``linear`` is not an ``nn.Linear``.
        """
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach().float()
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None).to(weight.device)
        # A row of zeros would give scale 0 and 0 / 0 below; any positive scale represents it exactly.
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        out.weight_int8.copy_(torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        out.scale.copy_(scale)
        if linear.bias is not None:
            out.bias.data = linear.bias.detach().clone()
        return out

    def dequantized_weight(self) -> Tensor:
        """The float32 weight the int8 values represent, ``(out_features, in_features)``."""
        return self.weight_int8.float() * self.scale[:, None]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling() and flat.shape[0] <= _FUSED_ROWS:
            # Inductor fuses the int8 -> float conversion into the reduction: one pass over the int8 weight,
            # nothing the size of the float weight is written (measured 5x faster than float32 at 8192 x 512).
            y = (flat[:, None, :] * self.weight_int8.to(flat.dtype)).sum(-1) * self.scale.to(flat.dtype)
        else:
            # The CPU/GPU kernel for int8 weights × float activations (no float copy of the weight).
            y = torch._weight_int8pack_mm(flat.contiguous(), self.weight_int8, self.scale.to(flat.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*rows, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(module: nn.Module, scheme: str = "int8") -> nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` by the registered quantized layer ``scheme``, in place.

    A weight shared between modules (a head tied to the embedding) is quantized as the linear layer's own copy;
    the embedding keeps its float weights.

    Args:
        module: the model (or any module); a bare ``nn.Linear`` cannot replace itself, so pass its parent.
        scheme: a name of ``blocks.names("quantization")``.

    Returns:
        ``module``, for chaining.

    Raises:
        ValueError: unknown ``scheme``, or a ``module`` that is itself an ``nn.Linear``.
    """
    if scheme not in names("quantization"):
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {names('quantization')}")
    if isinstance(module, nn.Linear):
        raise ValueError("quantize_linears replaces children: pass the module that holds the nn.Linear")
    layer_class = get("quantization", scheme)
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, layer_class.from_linear(child))
        else:
            quantize_linears(child, scheme)
    return module
