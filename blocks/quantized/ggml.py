"""The GGUF block formats (llama.cpp's ``Q8_0``, ``Q4_0`` ... ``Q6_K``) as ``quantization`` schemes.

A GGUF file stores a 2-d weight row by row, each row a run of blocks of ``block_size`` weights (32, or 256 for the
K-quants) in ``type_size`` bytes: float16 scales (and minimums) followed by packed integers. One
``GGMLLinear`` subclass per format keeps those bytes, split into their fields (``blocks_to_state``): each field of
every block of a row side by side, ``out_features`` rows first, so an embedding's gather and a row permutation are
plain indexing, and ``state_to_blocks`` gives the file's bytes back unchanged (exports copy the blocks). Formats
and their state, per row of ``nb`` blocks (bytes per block in parentheses):

- ``q8_0`` (34): ``d`` float16 ``(nb)``, ``qs`` int8 ``(nb·32)``; ``w = q · d``.
- ``q4_0`` (18): ``d``, ``qs`` uint8 ``(nb·16)`` (byte j: weight j in the low nibble, j + 16 in the high one);
  ``w = d · (q - 8)``.  ``q4_1`` (20): ``d``, ``m``, ``qs``; ``w = d · q + m``.
- ``q5_0`` (22) and ``q5_1`` (24): as ``q4_0`` / ``q4_1`` plus ``qh`` int32 ``(nb)``, the fifth bit of weight j in
  bit j; ``w = d · (q - 16)`` / ``d · q + m``.
- ``q2_k`` (84), ``q3_k`` (110), ``q4_k`` (144), ``q5_k`` (176), ``q6_k`` (210): super-blocks of 256 weights with
  a float16 ``d`` (and ``dmin``), 16 or 8 sub-block scales (and minimums) of 4, 6 or 8 bits, and the 2 to 6-bit
  weights in bit planes, each field kept as bytes in the file's order (``scales``, ``qs``, ``qh``, ``hmask``,
  ``ql``), except the 12 bytes of 6-bit scales of ``q3_k``, ``q4_k`` and ``q5_k``, kept one scale a byte (16 bytes:
  unpacking them inside every product costs more than the 4 extra bytes per 256 weights).

Unpacking (``decode``) equals ``gguf.quants.dequantize`` bit for bit: the same float32 operations in the same
order (float16 scales converted exactly, one rounding per product, sum or difference, never fused). Packing
(``from_float``) is ``gguf.quants.quantize`` where the gguf package has a quantizer (``q8_0`` to ``q5_1``); it has
none for the K-quants, which are only loaded from GGUF files (``from_blocks``).

Products (``linear``; ``benchmarks/quantized_kernels.py`` measures them):

- compiled, at most ``MAX_ROWS`` rows (decoding): the unpacking, written block-shaped (``decode_blocks``: every scale
  broadcast over a contiguous run of 16 or 32 weights), fused into a row-outer multiply-reduce: one pass over the
  packed bytes, no float weight written (SmolLM2's shapes, one thread: 0.9-2x the time of ``F.linear`` on the
  float32 weight, which reads 4-8x more bytes; the float arithmetic per weight, not memory, is the limit);
- compiled, more rows: chunks of ``CHUNK_ELEMENTS`` unpacked by one fused kernel each, then BLAS;
- eager: chunks of ``EAGER_CHUNK`` unpacked in the planes order (``BlockLayout``: long contiguous broadcasts), the
  offsets (minimums) multiplied by per-run sums of the inputs, BLAS. A chain of eager operations writes and reads
  the chunk several times: 3-10x ``F.linear``'s time for one row, 2-7x for 16 (``q5_0`` / ``q5_1``, whose fifth
  bits need a shift per weight, are the slowest).

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) computes ``q4_0``'s weights exactly (scale ``d``, zero 0),
but its float32 path is scalar (10-50x slower than BLAS here) and its bfloat16 path rounds the activations (relative
error 3e-3), so it is not used.

The fields are reinterpreted in the host's byte order, as the file's little-endian bytes (x86 and ARM hosts).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..small_matmul import MAX_ROWS
from . import cpu_kernels
from .base import CHUNK_ELEMENTS, QuantizedLinear
from .ggml_layout import BlockLayout, Codes, fused_block_linear

#: What to install for packing (the gguf package's quantizers).
INSTALL_HINT = "pip install 'transformer-zoo[gguf]'"
#: Floats of weight the eager path unpacks at a time (4 MiB; measured at 2^14 to 2^22: smaller chunks pay the
#: operations' fixed costs more often, larger ones fall out of cache).
EAGER_CHUNK = min(CHUNK_ELEMENTS, 1 << 20)
#: Weights per K-quant super-block (llama.cpp's QK_K).
QK_K = 256


class GGMLLinear(QuantizedLinear):
    """``nn.Linear`` whose weight is stored in a GGUF block format (one subclass per format).

    Args:
        in_features: a multiple of the format's ``block_size``.
        out_features: as ``nn.Linear``.
        bias: as ``nn.Linear``.

    Shapes: ``(..., in_features)`` -> ``(..., out_features)``.
    """

    #: the GGUF type name (``"Q8_0"``).
    ggml_type: ClassVar[str] = ""
    #: weights per block.
    block_size: ClassVar[int] = 32
    #: bytes per block.
    type_size: ClassVar[int] = 0
    #: one block's fields in the file's order: (state name, bytes, dtype of the state tensor).
    fields: ClassVar[tuple[tuple[str, int, torch.dtype], ...]] = ()
    #: the shape ``decode_blocks`` gives one block (its product is ``block_size``; the last dimension is a run of
    #: weights that share every scale, and the others index scales and bit planes).
    block_shape: ClassVar[tuple[int, ...]] = ()
    #: whether the gguf package can quantize to this format.
    has_quantizer: ClassVar[bool] = True
    #: fields kept unpacked in the state (their bytes -> ``unpack_field``): name -> state elements per block.
    unpacked_fields: ClassVar[dict[str, int]] = {}
    #: the order of ``block_shape``'s dimensions in the compiled product's loops (``fused_block_linear``).
    fused_order: ClassVar[tuple[int, ...] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.state_names = tuple(name for name, _, _ in cls.fields)
        if sum(size for _, size, _ in cls.fields) != cls.type_size:
            raise TypeError(f"{cls.__name__}: the fields {cls.fields} do not add up to {cls.type_size} bytes")

    # ---- the contract -------------------------------------------------------------------------------------------

    @classmethod
    def check_options(cls, in_features: int, **options: Any) -> dict[str, Any]:
        """No options; ``in_features`` must be a whole number of blocks.

        Args:
            in_features: the input width.
            **options: must be empty.

        Returns:
            ``{}``.

        Raises:
            ValueError: any option, or ``in_features`` not a multiple of ``block_size``.
        """
        super().check_options(in_features, **options)
        if in_features % cls.block_size:
            raise ValueError(f"{cls.ggml_type} packs rows in blocks of {cls.block_size} weights: in_features must be "
                             f"a multiple of {cls.block_size}, got in_features={in_features}")
        return {}

    @classmethod
    def packed_shapes(cls, in_features: int, out_features: int, **options: Any) -> dict[str, tuple[tuple, Any]]:
        blocks = in_features // cls.block_size
        return {name: ((out_features, blocks * cls._per_block(name)), dtype) for name, _, dtype in cls.fields}

    @classmethod
    def _per_block(cls, name: str) -> int:
        """Elements per block of a field's state tensor."""
        size, dtype = next((size, dtype) for n, size, dtype in cls.fields if n == name)
        return cls.unpacked_fields.get(name, size // dtype.itemsize)

    @classmethod
    def unpack_field(cls, name: str, field: Tensor) -> Tensor:
        """A field of ``unpacked_fields`` from its bytes to its values.

        Args:
            name: the field.
            field: its bytes.

        Returns:
            Its values, one a byte.

        Raises:
            NotImplementedError: in formats without unpacked fields.

        Shapes: ``(rows, blocks, size)`` -> ``(rows, blocks, n)``.
        """
        raise NotImplementedError

    @classmethod
    def pack_field(cls, name: str, state: Tensor) -> Tensor:
        """The inverse of ``unpack_field``.

        Args:
            name: the field.
            state: its values, one a byte.

        Returns:
            Its bytes.

        Raises:
            NotImplementedError: in formats without unpacked fields.

        Shapes: ``(rows, blocks, n)`` -> ``(rows, blocks, size)``.
        """
        raise NotImplementedError

    @classmethod
    def pack(cls, weight: Tensor, **options: Any) -> dict[str, Tensor]:
        """The packed tensors of a float ``(out, in)`` weight, quantized by ``gguf.quants.quantize``.

        Args:
            weight: the float weight.
            **options: none.

        Returns:
            ``state_names`` -> packed tensor.

        Shapes: weight ``(out, in)``.

        Raises:
            ValueError: the format has no quantizer in the gguf package (the K-quants).
            ImportError: the gguf package is not installed.
        """
        if not cls.has_quantizer:
            raise ValueError(f"{cls.ggml_type} can only be loaded from a GGUF file ({cls.__name__}.from_blocks), not "
                             "quantized here: the gguf package has no quantizer for it; use 'q8_0', 'q4_0', 'q4_1', "
                             "'q5_0' or 'q5_1'")
        try:
            from gguf.constants import GGMLQuantizationType
            from gguf.quants import quantize
        except ImportError as e:
            raise ImportError(f"quantizing to {cls.ggml_type} needs the gguf package: {INSTALL_HINT}") from e
        raw = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[cls.ggml_type])
        return cls.blocks_to_state(torch.from_numpy(raw).to(weight.device))

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        """The packed rows' integers, scales and offsets in ``layout`` (``BlockLayout``), pure torch: the weights
        are ``Codes.weights()``.

        Args:
            packed: ``state_names`` -> packed tensor.
            layout: the layout of the result.

        Returns:
            The codes.

        Raises:
            NotImplementedError: on the base class.

        Shapes: packed tensors with ``rows`` rows -> codes ``(rows, blocks, *block_shape)`` (in ``layout``).
        """
        raise NotImplementedError

    @classmethod
    def decode_layout(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Tensor:
        """The float32 weights of the packed rows in ``layout`` (``BlockLayout``), as ``gguf.quants`` computes them.

        Args:
            packed: ``state_names`` -> packed tensor.
            layout: the layout of the result.

        Returns:
            The weights.

        Shapes: -> ``(rows, blocks, *block_shape)`` in ``layout``.
        """
        return cls.codes(packed, layout).weights()

    @classmethod
    def decode_blocks(cls, packed: dict[str, Tensor], blocks: int, planes: bool = False) -> Tensor:
        """The float32 weights of packed rows of ``blocks`` blocks, ``(rows, blocks, *block_shape)`` (each block's
        weights in order when flattened) or in the planes order (``BlockLayout``).

        Args:
            packed: ``state_names`` -> packed tensor.
            blocks: blocks per row.
            planes: the planes order.

        Returns:
            The weights.

        Shapes: -> ``(rows, blocks, *block_shape)``.
        """
        rows = packed[cls.state_names[0]].shape[0]
        return cls.decode_layout(packed, BlockLayout(rows, blocks, cls.block_shape, planes))

    @classmethod
    def decode(cls, packed: dict[str, Tensor], in_features: int, **options: Any) -> Tensor:
        rows = packed[cls.state_names[0]].shape[0]
        return cls.decode_blocks(packed, in_features // cls.block_size).reshape(rows, in_features)

    # ---- GGUF blocks ----------------------------------------------------------------------------------------------

    @classmethod
    def blocks_to_state(cls, raw: Tensor) -> dict[str, Tensor]:
        """The packed tensors (``state_names``) of a 2-d tensor's blocks as the GGUF file stores them.

        Args:
            raw: uint8 ``(out_features, row_bytes)``, ``row_bytes = in_features / block_size · type_size``.

        Returns:
            ``state_names`` -> tensor with ``out_features`` rows (fresh memory, ``raw`` is not aliased).

        Raises:
            ValueError: ``raw`` is not a 2-d uint8 tensor with at least one row and a whole, positive number of
                blocks per row.

        Shapes: raw ``(out_features, row_bytes)``.
        """
        cls._check_raw(raw)
        rows, blocks = raw.shape[0], raw.shape[1] // cls.type_size
        by_block = raw.reshape(rows, blocks, cls.type_size)
        state, start = {}, 0
        for name, size, dtype in cls.fields:
            field = by_block[:, :, start:start + size].clone(memory_format=torch.contiguous_format)  # a copy
            if name in cls.unpacked_fields:
                field = cls.unpack_field(name, field)
            state[name] = field.view(dtype).reshape(rows, blocks * cls._per_block(name))
            start += size
        return state

    @classmethod
    def state_to_blocks(cls, packed: dict[str, Tensor]) -> Tensor:
        """The GGUF file's bytes of packed tensors: the inverse of ``blocks_to_state``, byte for byte.

        Args:
            packed: ``state_names`` -> tensor, as ``blocks_to_state`` (or a layer's ``packed()``) gives them.

        Returns:
            uint8 ``(out_features, row_bytes)``.

        Raises:
            ValueError: a tensor is missing or has a dtype or shape that does not fit the others.

        Shapes: -> ``(out_features, row_bytes)``.
        """
        missing = [name for name in cls.state_names if not isinstance(packed.get(name), Tensor)]
        if missing:
            raise ValueError(f"{cls.ggml_type} blocks need the packed tensors {list(cls.state_names)}, missing "
                             f"{missing}")
        first = packed[cls.state_names[0]]
        rows = first.shape[0] if first.dim() == 2 else -1
        blocks = first.shape[1] // cls._per_block(cls.state_names[0]) if first.dim() == 2 else -1
        pieces = []
        for name, size, dtype in cls.fields:
            t, per_block = packed[name], cls._per_block(name)
            expected = (rows, blocks * per_block)
            if t.dtype != dtype or tuple(t.shape) != expected or blocks < 1:
                raise ValueError(
                    f"{cls.ggml_type} packed tensor {name!r}: expected {dtype} of shape (rows, blocks * {per_block}) "
                    f"matching the others, {expected}, got {t.dtype} {tuple(t.shape)}")
            t = t.contiguous().view(rows, blocks, per_block)
            t = cls.pack_field(name, t) if name in cls.unpacked_fields else t.view(torch.uint8)
            pieces.append(t.reshape(rows, blocks, size))
        return torch.cat(pieces, dim=2).reshape(rows, blocks * cls.type_size)

    @classmethod
    def from_blocks(cls, raw: Tensor, bias: Tensor | None = None) -> GGMLLinear:
        """A layer holding a GGUF tensor's blocks (``blocks_to_state``), with ``bias`` kept as it is.

        Args:
            raw: uint8 ``(out_features, row_bytes)`` as the file stores it.
            bias: optional float ``(out_features,)``.

        Returns:
            The layer.

        Raises:
            ValueError: ``raw`` as ``blocks_to_state``, or ``bias`` not a float ``(out_features,)`` tensor.

        Shapes: raw ``(out_features, row_bytes)``, bias ``(out_features,)``.
        """
        cls._check_raw(raw)
        rows, in_features = raw.shape[0], raw.shape[1] // cls.type_size * cls.block_size
        if bias is not None and (not isinstance(bias, Tensor) or not bias.is_floating_point()
                                 or tuple(bias.shape) != (rows,)):
            got = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"{cls.__name__}.from_blocks: bias must be a float tensor of shape ({rows},), got {got}")
        with torch.device("meta"):  # no zero-filled skeleton: the blocks' tensors become the buffers
            layer = cls(in_features, rows, bias=bias is not None)
        for name, tensor in cls.blocks_to_state(raw).items():
            setattr(layer, name, tensor)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    def to_blocks(self) -> Tensor:
        """The layer's weight as the GGUF file's blocks (``state_to_blocks``).

        Returns:
            uint8 blocks.

        Shapes: -> ``(out_features, row_bytes)``.
        """
        return self.state_to_blocks(self.packed())

    @classmethod
    def _check_raw(cls, raw: Any) -> None:
        if not isinstance(raw, Tensor) or raw.dtype != torch.uint8 or raw.dim() != 2:
            got = f"{raw.dtype} {tuple(raw.shape)}" if isinstance(raw, Tensor) else type(raw).__name__
            raise ValueError(f"{cls.ggml_type} blocks must be a 2-d uint8 tensor (rows, row bytes), got {got}")
        if raw.shape[0] < 1 or raw.shape[1] < cls.type_size or raw.shape[1] % cls.type_size:
            raise ValueError(
                f"{cls.ggml_type} blocks of shape {tuple(raw.shape)}: expected at least one row and row bytes a "
                f"positive multiple of the block's {cls.type_size} bytes ({cls.block_size} weights each)")

    # ---- products -------------------------------------------------------------------------------------------------

    def linear(self, x: Tensor) -> Tensor:
        """``x @ unpack().T`` for ``x`` of shape ``(rows, in_features)``, without the bias, computed in float32.

        The 32-weight formats, float32 on the CPU, up to ``cpu_kernels.KERNEL_ROWS`` rows without gradients (eager
        or compiled): the hand-written kernel of ``cpu_kernels``. Otherwise, compiled with at most ``MAX_ROWS``
        rows and no gradients (decoding): the unpacking fused into a row-outer
        multiply-reduce (``fused_block_linear``); compiled otherwise: the base class's chunks and BLAS. Eager:
        ``EAGER_CHUNK`` floats of weight at a time, decoded in the planes order (``BlockLayout``) as ``scale · q``
        and multiplied by BLAS with the inputs taken in that order; the offsets (``Codes.scaled``) multiply the
        inputs' per-run sums.

        Args:
            x: the inputs.

        Returns:
            The product, float32.

        Shapes: x ``(rows, in_features)`` -> ``(rows, out_features)``.
        """
        blocks, n = self.in_features // self.block_size, x.shape[0]
        packed = self.packed()
        if n <= cpu_kernels.KERNEL_ROWS and cpu_kernels.usable(self.scheme, x, packed):
            # One pass over the packed bytes per 8 rows, weights unpacked in registers (see cpu_kernels).
            return cpu_kernels.ggml_mm(x, self.scheme, [packed[name] for name in cpu_kernels.FORMATS[self.scheme]])
        xf = x.to(torch.float32)
        if torch.compiler.is_compiling():
            if n > MAX_ROWS or torch.is_grad_enabled():
                return super().linear(x)  # chunks unpacked by one fused kernel each, then BLAS
            # The exact weights: offsets multiplied by the runs' input sums would be a second reduction, which
            # inductor vectorises over runs of 4 to 16 (Q4_K: 5x slower than this).
            weights = self.decode_blocks(packed, blocks)
            return fused_block_linear(xf, weights, order=self.fused_order).to(x.dtype)
        layout = BlockLayout(n, blocks, self.block_shape, planes=True)
        xp = layout.place(xf.reshape(n, blocks, *self.block_shape))  # (n, *planes, blocks, run)
        runs = xp.shape[1:-1]
        sums = xp.sum(-1).view(n, -1)  # (n, planes · blocks): what each run's offset multiplies
        xp = xp.view(n, self.in_features)

        def product(start: int, stop: int) -> Tensor:
            rows = stop - start
            layout = BlockLayout(rows, blocks, self.block_shape, planes=True)
            codes = self.codes(self.packed(slice(start, stop)), layout)
            weights, offsets = codes.scaled(integer_zero=True)
            y = F.linear(xp, weights.reshape(rows, self.in_features))
            if offsets is not None:
                y = y + F.linear(sums, offsets.expand(rows, *runs, 1).reshape(rows, -1))
            return y

        return self.in_chunks(EAGER_CHUNK, product).to(x.dtype)
