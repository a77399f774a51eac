"""``int8``: weight-only int8 with one float32 scale per output channel (symmetric), as torchao's
``Int8WeightOnlyConfig`` quantizes.

Packing is torchao's: ``choose_qparams_affine`` (symmetric, int8 range [-128, 127], so ``scale = max|w[o]| / 127.5``,
at least float32's eps) and ``quantize_affine`` (``q = clamp(round(w · (1 / scale)), -128, 127)``, half to even).
``w ≈ scale[o] · q[o, i]``: a quarter of float32's bytes; the error per weight is at most ``scale / 2``. Unpacking is
torchao's ``dequantize_affine`` bit for bit (``q · scale`` in float32). State: ``weight_int8`` int8 ``(out, in)``,
``scale`` float32 ``(out,)`` (checkpoints written before torchao packed them, with ``scale = max|w| / 127``, load
and run unchanged: only packing changed).

torchao is needed to pack (``from_float``), never to load or run a packed layer; ``torchao_primitives`` imports it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register
from ..small_matmul import MAX_ROWS, small_rows_linear
from .base import CHUNK_ELEMENTS, QuantizedLinear

#: What to install for packing (the ``quant`` extra pulls torchao).
INSTALL_HINT = "pip install 'transformer-zoo[quant]'"
#: Loggers that warn on torchao's first import (CUDA-only ``.so`` files it cannot load on CPU builds; an Enum
#: registration torch deprecates): noise for a user who only packs weights.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")
#: Float elements of weight an eager product unpacks at a time when the weight is split (1 MiB of float32): the
#: chunk is still in cache when BLAS reads it (SmolLM2's 49152x576 head: 1.2-1.5x faster than chunks of
#: CHUNK_ELEMENTS, benchmarks/quantized_int.py).
EAGER_CHUNK = min(CHUNK_ELEMENTS, 1 << 18)


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    """Raise the named loggers to ERROR for the duration (their levels are restored after)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def torchao_primitives() -> ModuleType:
    """``torchao.quantization.quant_primitives``, imported on first use (its load-time warnings silenced).

    Returns:
        The module (``choose_qparams_affine``, ``quantize_affine``, ``dequantize_affine``, ``MappingType`` ...).

    Raises:
        ImportError: torchao is not installed (the message says what to install).
    """
    name = "torchao.quantization.quant_primitives"
    if name in sys.modules and sys.modules[name] is not None:
        return sys.modules[name]
    try:
        with _quiet(_IMPORT_NOISE):
            import torchao.quantization.quant_primitives as primitives
    except ImportError as e:
        raise ImportError(f"packing quantized weights needs torchao: {INSTALL_HINT} (loading and running a packed "
                          "checkpoint does not)") from e
    return primitives


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
        # Exactly what Int8WeightOnlyConfig (Int8Tensor.from_hp, per row) computes; its eps (float32's) keeps a row
        # of zeros from dividing by zero.
        ao = torchao_primitives()
        # torchao reads a block of all ones as "no reduction" and then reduces over everything: one input per row
        # gets its qparams from the column twice (the same max|w|).
        rows = weight if weight.shape[1] > 1 else weight.expand(-1, 2)
        scale, zero = ao.choose_qparams_affine(
            rows, ao.MappingType.SYMMETRIC, [1, rows.shape[1]], torch.int8, quant_min=-128, quant_max=127,
            eps=torch.finfo(torch.float32).eps, scale_dtype=torch.float32, zero_point_dtype=torch.int8, keepdim=True,
        )
        q = ao.quantize_affine(weight, [1, weight.shape[1]], scale, zero, torch.int8, quant_min=-128, quant_max=127)
        return {"weight_int8": q, "scale": scale.reshape(-1)}

    @classmethod
    def decode(cls, packed: dict[str, Tensor], in_features: int, **options: Any) -> Tensor:
        # dequantize_affine's (q - 0) · scale: subtracting the zero point 0 changes no bits.
        return packed["weight_int8"].float() * packed["scale"].float()[:, None]

    def linear(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.shape[0] <= MAX_ROWS and not torch.is_grad_enabled():
            # Inductor fuses the int8 -> float conversion into the reduction: one pass over the int8 weight.
            return small_rows_linear(x, self.weight_int8, scale=self.scale)
        if x.shape[0] == 1 and x.device.type != "cpu" and not (x.requires_grad and torch.is_grad_enabled()):
            # The GPU kernel for int8 weights × float activations (no float copy of the weight; no backward).
            return torch._weight_int8pack_mm(x.contiguous(), self.weight_int8, self.scale.to(x.dtype))
        # On CPU, torch._weight_int8pack_mm is slower than a float copy and BLAS (1.5-2x for one row, 10-25x for 16
        # rows in benchmarks/quantized_int.py). A weight of at most CHUNK_ELEMENTS is copied whole (one BLAS call
        # is faster than several on SmolLM2's 576- and 1536-wide weights), a larger one EAGER_CHUNK elements at a
        # time; the scale is per output channel, so it applies after the product.
        if self.out_features * self.in_features <= CHUNK_ELEMENTS:
            return F.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)
        scale = self.scale.to(x.dtype)
        return self.in_chunks(EAGER_CHUNK, lambda a, b: F.linear(x, self.weight_int8[a:b].to(x.dtype)) * scale[a:b])
