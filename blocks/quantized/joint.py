"""GGUF-block layers that read the same input, multiplied in one call of the CPU kernel.

Decoding one token calls a product per layer, and each call costs a few microseconds of dispatch (more from a
compiled graph's Python wrapper) beside the product itself: a Llama-style layer makes seven. Attention's q, k and
v projections, and a gated feed-forward's gate and up projections, read the same input; ``joint_linear`` sends them
to ``cpu_kernels.ggml_mm_joint`` together (one call, one output, each weight in its own format and memory), and
the results are column slices of that output — the same values as the separate calls, which write each output row
with the same kernel and the same order of sums.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from . import cpu_kernels
from .ggml import GGMLLinear


def joint_linear(x: Tensor, layers: Sequence[nn.Module]) -> tuple[Tensor, ...] | None:
    """Each layer applied to ``x`` in one kernel call, or None when that does not apply: fewer than two layers,
    a layer that is not a plain ``GGMLLinear`` of a ``cpu_kernels.FORMATS`` scheme (hooks, adapters, other
    types), different input widths, more than ``cpu_kernels.KERNEL_ROWS`` rows, or the kernel not usable
    (``cpu_kernels.usable``: float32 on the CPU, no gradient, the kernel built).

    Args:
        x: the shared input.
        layers: the layers, in the order of the results.

    Returns:
        ``tuple(layer(x) for layer in layers)``, computed together, or None.

    Shapes: ``x (..., in_features)`` -> each ``(..., out_features_i)``.
    """
    if len(layers) < 2 or not all(_plain(layer) for layer in layers):
        return None
    width = layers[0].in_features
    if x.shape[-1] != width or any(layer.in_features != width for layer in layers):
        return None
    flat = x.reshape(-1, width)
    if flat.shape[0] > cpu_kernels.KERNEL_ROWS:
        return None
    weights = []
    for layer in layers:
        packed = layer.packed()
        if not cpu_kernels.usable(layer.scheme, flat, packed):
            return None
        weights.append((layer.scheme, [packed[name] for name in cpu_kernels.FORMATS[layer.scheme]]))
    y = cpu_kernels.ggml_mm_joint(flat, weights)
    outputs = y.split([layer.out_features for layer in layers], dim=-1)
    return tuple(
        (out if layer.bias is None else out + layer.bias.to(out.dtype)).reshape(*x.shape[:-1], layer.out_features)
        for layer, out in zip(layers, outputs, strict=True)
    )


def _plain(layer: nn.Module) -> bool:
    return (isinstance(layer, GGMLLinear) and layer.scheme in cpu_kernels.FORMATS and not layer._forward_hooks
            and not layer._forward_pre_hooks and type(layer).forward is GGMLLinear.forward)

