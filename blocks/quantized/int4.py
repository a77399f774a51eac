"""``int4``: group-wise weight-only int4, as torchao's ``Int4WeightOnlyConfig`` (tinygemm) quantizes.

Every ``group_size`` consecutive inputs of an output row share a float32 ``scale`` and ``zero``; each weight is a
4-bit ``n`` in [0, 15] and represents ``(n - 8) · scale + zero`` (torchao's float zero-point domain, the formula of
torch's tinygemm kernels). Options:

- ``group_size``: 32, 64 or 128 (default 128, torchao's default; the group sizes torchao's CPU int4 layout takes);
- ``symmetric``: ``False`` (default): asymmetric, as ``Int4WeightOnlyConfig``: ``scale = (max - min) / 15`` (at
  least 1e-6), ``zero = min + 8 · scale`` (``_choose_qparams_affine_tinygemm``, ``_quantize_affine_tinygemm``: the
  parameters of torchao's CPU int4 tensor). ``True``: torchao's symmetric int4 (``IntxWeightOnlyConfig`` with
  ``MappingType.SYMMETRIC``): ``choose_qparams_affine`` over [-8, 7], ``scale = max|w| / 7.5``, zero point 0, so
  ``zero`` holds zeros and ``n - 8`` is the int4 value.

Unpacking equals torchao's reference bit for bit: ``_dequantize_affine_tinygemm`` (``(n - 8) · scale``, rounded,
``+ zero``, rounded) for the asymmetric scheme, ``dequantize_affine`` for the symmetric one.

State (``out_features`` rows first): ``qweight`` uint8 ``(out, in / 2)``, ``scale`` and ``zero`` float32
``(out, in / group_size)``. Byte ``j`` of a group's ``group_size / 2`` bytes holds the group's input ``j`` in its low
nibble and input ``j + group_size / 2`` in its high nibble (llama.cpp's Q4_0 order): a fused decode then reads two
contiguous half-groups of the activations, which inductor vectorises (adjacent pairs would need strided loads).
0.5 bytes per weight plus 8 bytes per group.

Kernels: compiled with at most ``MAX_ROWS`` rows, the unpacking is fused into a row-outer multiply-reduce (one pass
over the packed bytes, no float weight written); eager bfloat16 on CPU, ``torch.ops.aten._weight_int4pack_mm_for_cpu``
on a packed copy built on first use (a cache, never state; 2-5x faster than ``F.linear`` on float32 for one row);
otherwise the weight is unpacked ``EAGER_CHUNK`` elements at a time and multiplied by BLAS (torch's int4 kernel on
float32 inputs ties with that for one row and is 10-40x slower for 16, ``benchmarks/quantized_int.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register
from ..small_matmul import MAX_ROWS
from .base import QuantizedLinear
from .int8 import EAGER_CHUNK, torchao_primitives

#: The group sizes a layer takes (torchao's CPU int4 layout takes these).
GROUP_SIZES = (32, 64, 128)
#: Smallest scale of the asymmetric scheme (torchao's CPU int4 tensor, Int4OpaqueTensor.from_hp).
_EPS = 1e-6
#: torch's CPU int4 kernel packs output channels in sixteens.
_KERNEL_ROWS = 16


@register("quantization", "int4")
class Int4Linear(QuantizedLinear):
    """``nn.Linear`` with group-wise int4 weights (a float32 scale and zero per ``group_size`` inputs).

    Args:
        in_features: as ``nn.Linear``.
        out_features: as ``nn.Linear``.
        bias: as ``nn.Linear``.
        **options: ``group_size``, the inputs sharing a scale and zero: 32, 64 or 128 (default 128), dividing
            ``in_features``; ``symmetric``: ``True`` for torchao's symmetric int4 (zero 0), ``False`` (default) for
            its asymmetric one.

    Raises:
        ValueError: an unknown option, a bad ``group_size`` or ``symmetric``, or a group size that does not divide
            ``in_features``.

    Shapes: ``(..., in_features)`` -> ``(..., out_features)``.
    """

    scheme: ClassVar[str] = "int4"
    state_names: ClassVar[tuple[str, ...]] = ("qweight", "scale", "zero")

    @classmethod
    def check_options(cls, in_features: int, **options: Any) -> dict[str, Any]:
        unknown = sorted(set(options) - {"group_size", "symmetric"})
        if unknown:
            raise ValueError(f"quantization scheme 'int4' takes the options ['group_size', 'symmetric'], got unknown "
                             f"{unknown}")
        group_size, symmetric = options.get("group_size", 128), options.get("symmetric", False)
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {list(GROUP_SIZES)}, got {group_size!r}")
        if not isinstance(symmetric, bool):
            raise ValueError(f"int4 symmetric must be True or False, got {symmetric!r}")
        if in_features % group_size:
            raise ValueError(f"int4 needs in_features divisible by group_size: in_features {in_features} is not a "
                             f"multiple of group_size {group_size}")
        return {"group_size": int(group_size), "symmetric": symmetric}

    @classmethod
    def packed_shapes(cls, in_features: int, out_features: int, **options: Any) -> dict[str, tuple[tuple, Any]]:
        groups = in_features // options["group_size"]
        return {"qweight": ((out_features, in_features // 2), torch.uint8),
                "scale": ((out_features, groups), torch.float32), "zero": ((out_features, groups), torch.float32)}

    @classmethod
    def pack(cls, weight: Tensor, **options: Any) -> dict[str, Tensor]:
        ao = torchao_primitives()
        out_features, in_features = weight.shape
        group_size = options["group_size"]
        block = [1, group_size]
        if options["symmetric"]:
            scale, zero_point = ao.choose_qparams_affine(
                weight, ao.MappingType.SYMMETRIC, block, torch.int8, quant_min=-8, quant_max=7,
                scale_dtype=torch.float32, zero_point_dtype=torch.int8, keepdim=True,
            )
            nibbles = ao.quantize_affine(weight, block, scale, zero_point, torch.int8, quant_min=-8, quant_max=7) + 8
            zero = torch.zeros_like(scale)
        else:
            # torchao's public choose_qparams_affine has no float zero-point domain since 0.11: these are the
            # functions its int4 tensors (Int4OpaqueTensor, Int4TilePackedTo4dTensor) call.
            scale, zero = ao._choose_qparams_affine_tinygemm(
                weight, ao.MappingType.ASYMMETRIC, block, torch.int32, quant_min=0, quant_max=15, eps=_EPS,
                scale_dtype=torch.float32, zero_point_dtype=torch.float32,
            )
            nibbles = ao._quantize_affine_tinygemm(weight, block, scale, zero, torch.int32, quant_min=0, quant_max=15)
        halves = nibbles.to(torch.uint8).view(out_features, -1, 2, group_size // 2)  # (out, groups, 2, group / 2)
        qweight = halves[:, :, 0] | (halves[:, :, 1] << 4)
        return {"qweight": qweight.reshape(out_features, in_features // 2),
                "scale": scale.reshape(out_features, -1).float(), "zero": zero.reshape(out_features, -1).float()}

    @classmethod
    def decode(cls, packed: dict[str, Tensor], in_features: int, **options: Any) -> Tensor:
        scale, zero = packed["scale"].float(), packed["zero"].float()
        rows, groups = scale.shape
        b = packed["qweight"].view(rows, groups, 1, -1)
        nibbles = torch.cat([b & 15, b >> 4], dim=2)  # (rows, groups, 2, group / 2): low half, then high half
        # torchao's order of operations, two roundings: (n - 8) · scale, then + zero.
        return ((nibbles.float() - 8.0) * scale[:, :, None, None] + zero[:, :, None, None]).view(rows, in_features)

    @property
    def group_size(self) -> int:
        """Inputs sharing one scale and zero."""
        return self._options["group_size"]

    def linear(self, x: Tensor) -> Tensor:
        """``x @ unpack().T`` without the bias (see the module docstring for the kernel each case takes).

        Args:
            x: the inputs.

        Returns:
            The product.

        Shapes: x ``(rows, in_features)`` -> ``(rows, out_features)``.
        """
        if torch.compiler.is_compiling():
            if x.shape[0] <= MAX_ROWS and not torch.is_grad_enabled():
                return fused_int4_linear(x, self.qweight, self.scale, self.zero)
            return super().linear(x)  # chunked unpacking (pure torch) and BLAS
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled()):
            # (the kernel has no backward: an input that needs gradients, e.g. under an adapter, takes BLAS)
            packed, scales_and_zeros = self._kernel_weights(x.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, self.group_size, scales_and_zeros)
            return y[:, :self.out_features]
        return self.in_chunks(EAGER_CHUNK, lambda a, b: F.linear(x, self._unpack_rows(a, b).to(x.dtype)))

    def _unpack_rows(self, start: int, stop: int) -> Tensor:
        """``unpack()[start:stop]`` (the same bits as ``decode``), written in place into one buffer: fewer passes
        over fresh memory than ``decode``'s chain of operations, for eager mode."""
        b, scale, zero = self.qweight[start:stop], self.scale[start:stop].float(), self.zero[start:stop].float()
        rows, groups = scale.shape
        b = b.view(rows, groups, 1, -1)
        w = torch.empty(rows, groups, 2, b.shape[-1], device=b.device)
        w[:, :, :1].copy_(b & 15)
        w[:, :, 1:].copy_(b >> 4)
        w.sub_(8.0).mul_(scale[:, :, None, None]).add_(zero[:, :, None, None])
        return w.view(rows, self.in_features)

    def _kernel_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The packed weight and scales-and-zeros ``_weight_int4pack_mm_for_cpu`` takes, built on first use and kept
        until the packed tensors change (loaded, replaced, moved or written in place: their storage or version is
        the key), so a loaded state dict never meets a stale copy. Not state: ``state_dict`` never holds it.

        The kernel computes each weight as one fused multiply-add, ``fma(n - 8, scale, zero)`` (the float32 path;
        the bfloat16 path with bfloat16 scales and zeros), not ``unpack()``'s two roundings.
        """
        key = (dtype, *(_version_key(getattr(self, name)) for name in self.state_names))
        cached = self.__dict__.get("_kernel_cache")
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        self.__dict__.pop("_kernel_cache", None)  # free the stale copy before building the new one
        rows = -(-self.out_features // _KERNEL_ROWS) * _KERNEL_ROWS
        b = self.qweight.view(self.out_features, -1, 1, self.group_size // 2)
        nibbles = torch.full((rows, self.in_features), 8, dtype=torch.int32, device=b.device)  # padding rows: 0
        nibbles[:self.out_features] = torch.cat([b & 15, b >> 4], dim=2).reshape(self.out_features, -1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        pairs = torch.zeros(rows, self.scale.shape[1], 2, dtype=dtype, device=b.device)
        pairs[:self.out_features, :, 0], pairs[:self.out_features, :, 1] = self.scale, self.zero
        scales_and_zeros = pairs.transpose(0, 1).contiguous()  # (groups, rows, 2)
        self.__dict__["_kernel_cache"] = (key, packed, scales_and_zeros)
        return packed, scales_and_zeros


def _version_key(t: Tensor) -> tuple[int, torch.device, int]:
    """Storage, device and in-place version of ``t`` (an inference tensor keeps no version: its storage alone)."""
    try:
        version = t._version
    except RuntimeError:
        version = -1
    return t.data_ptr(), t.device, version


def fused_int4_linear(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """``x @ W.T`` for the int4 weight ``W`` that ``qweight``, ``scale`` and ``zero`` pack, written so that inductor
    unpacks inside the reduction (compiled decoding): each byte gives the weights of two contiguous half-groups,
    computed as ``Int4Linear.decode`` computes them, and multiplied by the matching halves of ``x``; no float
    weight is ever stored. In eager mode this materialises ``rows × out × in`` products: compile it.

    Args:
        x: ``(rows, in)`` activations.
        qweight: ``(out, in / 2)`` uint8, ``Int4Linear``'s layout.
        scale: ``(out, in / group_size)``.
        zero: ``(out, in / group_size)``.

    Returns:
        ``(rows, out)`` in ``x``'s dtype.

    Raises:
        ValueError: shapes that do not fit together.

    Shapes: x ``(rows, in)``, qweight ``(out, in / 2)``, scale and zero ``(out, in / group_size)`` -> ``(rows, out)``.
    """
    out, groups = scale.shape
    if x.dim() != 2 or qweight.shape[0] != out or x.shape[1] != 2 * qweight.shape[1] or x.shape[1] % groups:
        raise ValueError(f"fused_int4_linear needs x (rows, in), qweight (out, in / 2) and scale (out, groups), got "
                         f"x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scale {tuple(scale.shape)}")
    half = x.shape[1] // groups // 2
    b = qweight.view(out, groups, half)
    scale, zero = scale.float()[:, :, None], zero.float()[:, :, None]
    low = ((b & 15).float() - 8.0) * scale + zero  # (out, groups, half): inputs j of each group
    high = ((b >> 4).float() - 8.0) * scale + zero  # inputs j + half
    halves = x.view(x.shape[0], 1, groups, 2, half)
    return (halves[:, :, :, 0] * low + halves[:, :, :, 1] * high).sum((-2, -1)).to(x.dtype)
