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

import math
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..registry import register
from ..small_matmul import MAX_ROWS
from . import cpu_kernels
from .base import CHUNK_ELEMENTS, QuantizedLinear

#: What to install for packing (the gguf package's quantizers).
INSTALL_HINT = "pip install 'transformer-zoo[gguf]'"
#: Floats of weight the eager path unpacks at a time (4 MiB; measured at 2^14 to 2^22: smaller chunks pay the
#: operations' fixed costs more often, larger ones fall out of cache).
EAGER_CHUNK = min(CHUNK_ELEMENTS, 1 << 20)
#: Weights per K-quant super-block (llama.cpp's QK_K).
QK_K = 256


def _f32(t: Tensor) -> Tensor:
    return t.to(torch.float32)


class BlockLayout:
    """How the weights of ``rows`` packed rows of ``blocks`` blocks are laid out while a format decodes them. Every
    tensor has ``2 + len(block_shape)`` dimensions, in one of two orders:

    - blocks (``planes=False``): ``(rows, blocks, *block_shape)``, each block's weights in order (unpacking, and
      the compiled product, where inductor then loads every scale once per contiguous run);
    - planes (``planes=True``): ``(rows, *block_shape[:-1], blocks, block_shape[-1])``: a row's weights grouped by
      their position in the block (the nibble, the bit plane, the run), so that the shifts that pick bits and most
      scales broadcast over long contiguous stretches, where eager kernels are fast (over runs of 16 they are up to
      10x slower); the eager product multiplies the inputs taken in the same order.

    Elementwise operations commute with the reordering, so a format writes its decoding once, on tensors from
    ``field``, ``small`` and ``bits``.

    Args:
        rows, blocks: rows and blocks per row of the packed tensors.
        block_shape: the format's ``block_shape``.
        planes: the planes order.
    """

    def __init__(self, rows: int, blocks: int, block_shape: tuple[int, ...], planes: bool = False) -> None:
        self.rows, self.blocks, self.planes = rows, blocks, planes
        self.ndim = 2 + len(block_shape)
        self.order = (0, *range(2, self.ndim - 1), 1, self.ndim - 1) if planes else tuple(range(self.ndim))

    def place(self, t: Tensor) -> Tensor:
        """A full-rank tensor in the blocks order, in this layout (planes: contiguous, a copy where it moves data)."""
        return t.permute(self.order).contiguous() if self.planes else t

    def field(self, t: Tensor, *shape: int) -> Tensor:
        """A packed field ``(rows, blocks · prod(shape))`` seen as ``(rows, blocks, 1, ..., *shape)``."""
        return self.place(t.view(self.rows, self.blocks, *([1] * (self.ndim - 2 - len(shape))), *shape))

    def small(self, t: Tensor, *shape: int) -> Tensor:
        """A per-block tensor ``(rows, blocks, ...)`` (unpacked scales) seen as ``(rows, blocks, *shape)``, padded as
        ``field``."""
        return self.field(t.reshape(self.rows, self.blocks * math.prod(shape)), *shape)

    def word(self, t: Tensor, count: int, k: int) -> Tensor:
        """Word ``k`` of the ``count`` words per block of a packed field ``(rows, blocks · count)``, broadcast over
        the block."""
        return self.small(t.view(self.rows, self.blocks, count)[:, :, k], *([1] * (self.ndim - 2)))

    def index(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """``0, 1, ...`` over the per-block ``shape`` (like ``bits``' shifts), placed against full-rank tensors."""
        i = _shifts(shape, 1, like)
        return self.place(i.view(*([1] * (self.ndim - i.dim())), *shape))

    def bits(self, t: Tensor, shape: tuple[int, ...], step: int, mask: int) -> Tensor:
        """``(t >> shift) & mask`` with ``shift = step · i``, ``i`` counting 0, 1, ... over the per-block ``shape``
        (an ``arange``, never a tensor constant: inductor loses constants inside some compiled subgraphs).

        In the blocks order an 8-bit ``t`` gives float32 (the same integers): ``float(t & (mask << shift)) ·
        2^-shift``, exact. Compiled, 8-bit shifts are emulated by shuffles (AVX-512 has none), and converting
        bytes to 32-bit integers goes element by element when inductor takes 32 at a time; masking bytes and
        converting them to float is vectorised."""
        shift = _shifts(shape, step, t)
        shift = self.place(shift.view(*([1] * (self.ndim - shift.dim())), *shape))
        if not self.planes and t.element_size() == 1:
            return _f32(t & (mask << shift)) * (1.0 / _f32(1 << shift))
        return (t >> shift) & mask


def _shifts(shape: tuple[int, ...], step: int, like: Tensor) -> Tensor:
    """``step · arange`` of ``shape``, in ``like``'s dtype and device."""
    return (torch.arange(math.prod(shape), dtype=like.dtype, device=like.device) * step).view(shape)


class Codes(NamedTuple):
    """A block format's weights as ``scale · (q - zero) + offset``: ``q`` integers, ``zero`` a constant, ``scale``
    and ``offset`` float32 per run of weights (broadcast), all in one ``BlockLayout``."""

    q: Tensor
    zero: int
    scale: Tensor
    offset: Tensor | None = None

    def weights(self) -> Tensor:
        """The float32 weights, bit for bit as ``gguf.quants``: ``q - zero`` is exact in float32, then one rounding
        for the product and one for the offset (``a - b`` and ``a + (-b)`` round alike)."""
        q = _f32(self.q) - self.zero if self.zero else _f32(self.q)
        w = self.scale * q
        return w if self.offset is None else w + self.offset

    def scaled(self, integer_zero: bool = False) -> tuple[Tensor, Tensor | None]:
        """For a product: ``(scale · (q - zero), offset)``: the weights before their offsets (the same bits as in
        ``weights()``), and the offsets, which then multiply sums of inputs over each run instead of every weight.

        Args:
            integer_zero: subtract ``zero`` before converting ``q`` to float (one pass over bytes instead of floats:
                faster in eager mode; compiled, the float subtraction vectorises better).
        """
        if not self.zero:
            q = _f32(self.q)
        elif integer_zero:  # every code is below 128, so int8 holds it and the difference
            q = _f32((self.q.to(torch.int8) if self.q.dtype == torch.uint8 else self.q) - self.zero)
        else:
            q = _f32(self.q) - self.zero
        return self.scale * q, self.offset


class GGMLLinear(QuantizedLinear):
    """``nn.Linear`` whose weight is stored in a GGUF block format (one subclass per format).

    Args:
        in_features: a multiple of the format's ``block_size``.
        out_features, bias: as ``nn.Linear``.

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

    def _apply(self, fn: Any, recurse: bool = True) -> GGMLLinear:
        # model.to(dtype) casts floating buffers: the float16 scales would go through that dtype and back (lossy for
        # bfloat16), so they keep their values and only follow the device.
        before = {name: getattr(self, name) for name in self.state_names}
        super()._apply(fn, recurse)
        for name, tensor in before.items():
            after = getattr(self, name)
            if after is not tensor and tensor.is_floating_point():
                setattr(self, name, tensor.to(after.device))
        return self

    # ---- the contract -------------------------------------------------------------------------------------------

    @classmethod
    def check_options(cls, in_features: int, **options: Any) -> dict[str, Any]:
        """No options; ``in_features`` must be a whole number of blocks.

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
        """A field of ``unpacked_fields`` from its bytes ``(rows, blocks, size)`` to ``(rows, blocks, n)``."""
        raise NotImplementedError

    @classmethod
    def pack_field(cls, name: str, state: Tensor) -> Tensor:
        """The inverse of ``unpack_field``: ``(rows, blocks, n)`` -> the field's bytes ``(rows, blocks, size)``."""
        raise NotImplementedError

    @classmethod
    def pack(cls, weight: Tensor, **options: Any) -> dict[str, Tensor]:
        """The packed tensors of a float ``(out, in)`` weight, quantized by ``gguf.quants.quantize``.

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
        are ``Codes.weights()``."""
        raise NotImplementedError

    @classmethod
    def decode_layout(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Tensor:
        """The float32 weights of the packed rows in ``layout`` (``BlockLayout``), as ``gguf.quants`` computes them."""
        return cls.codes(packed, layout).weights()

    @classmethod
    def decode_blocks(cls, packed: dict[str, Tensor], blocks: int, planes: bool = False) -> Tensor:
        """The float32 weights of packed rows of ``blocks`` blocks, ``(rows, blocks, *block_shape)`` (each block's
        weights in order when flattened) or in the planes order (``BlockLayout``)."""
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

        Raises:
            ValueError: ``raw`` as ``blocks_to_state``, or ``bias`` not a float ``(out_features,)`` tensor.
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
        """The layer's weight as the GGUF file's blocks, uint8 ``(out_features, row_bytes)`` (``state_to_blocks``)."""
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
        """
        blocks, n = self.in_features // self.block_size, x.shape[0]
        if n <= cpu_kernels.KERNEL_ROWS and cpu_kernels.usable(self.scheme, x, self.packed()):
            # One pass over the packed bytes per 8 rows, weights unpacked in registers (see cpu_kernels).
            packed = self.packed()
            return cpu_kernels.ggml_mm(x, self.scheme, [packed[name] for name in cpu_kernels.FORMATS[self.scheme]])
        xf = x.to(torch.float32)
        if torch.compiler.is_compiling():
            if n > MAX_ROWS or torch.is_grad_enabled():
                return super().linear(x)  # chunks unpacked by one fused kernel each, then BLAS
            # The exact weights: offsets multiplied by the runs' input sums would be a second reduction, which
            # inductor vectorises over runs of 4 to 16 (Q4_K: 5x slower than this).
            weights = self.decode_blocks(self.packed(), blocks)
            return fused_block_linear(xf, weights, order=self.fused_order).to(x.dtype)
        layout = BlockLayout(n, blocks, self.block_shape, planes=True)
        xp = layout.place(xf.reshape(n, blocks, *self.block_shape))  # (n, *planes, blocks, run)
        runs = xp.shape[1:-1]
        sums = xp.sum(-1).view(n, -1)  # (n, planes · blocks): what each run's offset multiplies
        xp = xp.view(n, self.in_features)
        step = max(1, EAGER_CHUNK // self.in_features)
        pieces = []
        for start in range(0, self.out_features, step):
            packed = self.packed(slice(start, start + step))
            rows = packed[self.state_names[0]].shape[0]
            codes = self.codes(packed, BlockLayout(rows, blocks, self.block_shape, planes=True))
            weights, offsets = codes.scaled(integer_zero=True)
            y = F.linear(xp, weights.reshape(rows, self.in_features))
            if offsets is not None:
                y = y + F.linear(sums, offsets.expand(rows, *runs, 1).reshape(rows, -1))
            pieces.append(y)
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return y.to(x.dtype)


def fused_block_linear(x: Tensor, weights: Tensor, offsets: Tensor | None = None,
                       order: tuple[int, ...] | None = None) -> Tensor:
    """``x @ W.T`` for ``W = weights + offsets`` given block-shaped (``GGMLLinear.codes(...).scaled()`` in the blocks
    order), written so that inductor computes each weight inside the reduction: for every output row, the input row's
    matching runs times the weights, the blocks' dimensions kept apart so that every scale is loaded once per run,
    and the offsets times the runs' input sums. In eager mode this materialises ``rows × out × in`` products:
    compile it.

    Args:
        x: ``(rows, in)`` float32.
        weights: ``(out, blocks, *block_shape)`` float32 with ``blocks · prod(block_shape) = in``.
        offsets: optional float32 per run, broadcastable to ``(out, blocks, *block_shape[:-1], 1)``.
        order: a permutation of ``block_shape``'s dimensions for the loops: inductor merges two dimensions that
            every tensor reads contiguously and vectorises 32 weights at a time where the inputs hold float16
            scales, converting 32 bytes to 32-bit integers one by one (Q4_K: 5x slower than 16 at a time).

    Returns:
        ``(rows, out)`` float32.

    Raises:
        ValueError: ``x`` does not fit ``weights``.
    """
    block_dims = tuple(weights.shape[1:])
    if x.dim() != 2 or x.shape[1] != weights[0].numel():
        raise ValueError(f"fused_block_linear needs x (rows, {weights[0].numel()}) for weight blocks "
                         f"{tuple(weights.shape)}, got x {tuple(x.shape)}")
    xb = x.reshape(1, x.shape[0], *block_dims)
    dims = tuple(range(2, 2 + len(block_dims)))
    if order is not None:
        xb = xb.permute(0, 1, 2, *(3 + i for i in order))
        weights = weights.permute(0, 1, *(2 + i for i in order))
    y = (xb * weights[:, None]).sum(dims)  # (out, rows)
    if offsets is not None:
        y = y + (xb.sum(-1, keepdim=True) * offsets[:, None]).sum(dims)
    return y.t()


# ---- the 32-weight formats ---------------------------------------------------------------------------------------


@register("quantization", "q8_0")
class Q8_0Linear(GGMLLinear):
    """``Q8_0``: 32 int8 weights and a float16 scale per block (8.5 bits per weight)."""

    scheme = "q8_0"
    ggml_type = "Q8_0"
    type_size = 34
    fields = (("d", 2, torch.float16), ("qs", 32, torch.int8))
    block_shape = (32,)

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        return Codes(layout.field(packed["qs"], 32), 0, _f32(layout.field(packed["d"], 1)))  # gguf: x · d


@register("quantization", "q4_0")
class Q4_0Linear(GGMLLinear):
    """``Q4_0``: 32 4-bit weights (offset 8) and a float16 scale per block (4.5 bits per weight)."""

    scheme = "q4_0"
    ggml_type = "Q4_0"
    type_size = 18
    fields = (("d", 2, torch.float16), ("qs", 16, torch.uint8))
    #: (nibble, weight): weight 16·nibble + j is that nibble of byte j.
    block_shape = (2, 16)

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        q = layout.bits(layout.field(packed["qs"], 1, 16), (2, 1), 4, 15)
        return Codes(q, 8, _f32(layout.field(packed["d"], 1, 1)))  # gguf: d · float(q - 8)


@register("quantization", "q4_1")
class Q4_1Linear(GGMLLinear):
    """``Q4_1``: 32 4-bit weights, a float16 scale and minimum per block (5 bits per weight)."""

    scheme = "q4_1"
    ggml_type = "Q4_1"
    type_size = 20
    fields = (("d", 2, torch.float16), ("m", 2, torch.float16), ("qs", 16, torch.uint8))
    #: as ``Q4_0``.
    block_shape = (2, 16)

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        q = layout.bits(layout.field(packed["qs"], 1, 16), (2, 1), 4, 15)
        d, m = layout.field(packed["d"], 1, 1), layout.field(packed["m"], 1, 1)
        return Codes(q, 0, _f32(d), _f32(m))  # gguf: d · q + m


def _five_bits(packed: dict[str, Tensor], layout: BlockLayout) -> Tensor:
    """The 5-bit integers of ``Q5_0`` / ``Q5_1`` blocks (``block_shape`` (2, 16)): low nibbles from ``qs`` as
    ``Q4_0``, the fifth bit of weight j from bit j of the block's ``qh`` word."""
    low = layout.bits(layout.field(packed["qs"], 1, 16), (2, 1), 4, 15)
    high = layout.bits(layout.field(packed["qh"], 1, 1), (2, 16), 1, 1)
    return low + high * 16


@register("quantization", "q5_0")
class Q5_0Linear(GGMLLinear):
    """``Q5_0``: 32 5-bit weights (offset 16) and a float16 scale per block (5.5 bits per weight)."""

    scheme = "q5_0"
    ggml_type = "Q5_0"
    type_size = 22
    fields = (("d", 2, torch.float16), ("qh", 4, torch.int32), ("qs", 16, torch.uint8))
    block_shape = (2, 16)

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        return Codes(_five_bits(packed, layout), 16, _f32(layout.field(packed["d"], 1, 1)))  # gguf: d · float(q - 16)


@register("quantization", "q5_1")
class Q5_1Linear(GGMLLinear):
    """``Q5_1``: 32 5-bit weights, a float16 scale and minimum per block (6 bits per weight)."""

    scheme = "q5_1"
    ggml_type = "Q5_1"
    type_size = 24
    fields = (("d", 2, torch.float16), ("m", 2, torch.float16), ("qh", 4, torch.int32), ("qs", 16, torch.uint8))
    block_shape = (2, 16)

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        d, m = layout.field(packed["d"], 1, 1), layout.field(packed["m"], 1, 1)
        return Codes(_five_bits(packed, layout), 0, _f32(d), _f32(m))  # gguf: d · q + m


# ---- the K-quants: super-blocks of 256 weights -------------------------------------------------------------------


@register("quantization", "q2_k")
class Q2_KLinear(GGMLLinear):
    """``Q2_K``: 2-bit weights in 16 runs of 16, each with a 4-bit scale and minimum (2.625 bits per weight)."""

    scheme = "q2_k"
    ggml_type = "Q2_K"
    block_size = QK_K
    type_size = 84
    fields = (("scales", 16, torch.uint8), ("qs", 64, torch.uint8), ("d", 2, torch.float16),
              ("dmin", 2, torch.float16))
    #: (half, shift, run of 16, weight): weight 128·half + 32·shift + j is bits 2·shift of byte 32·half + j.
    block_shape = (2, 4, 2, 16)
    has_quantizer = False

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        q = layout.bits(layout.field(packed["qs"], 2, 1, 2, 16), (4, 1, 1), 2, 3)
        scales = layout.field(packed["scales"], 2, 4, 2, 1)  # one per run of 16, in weight order
        d, dmin = layout.field(packed["d"], 1, 1, 1, 1), layout.field(packed["dmin"], 1, 1, 1, 1)
        dl, ml = _f32(d) * _f32(scales & 15), _f32(dmin) * _f32(scales >> 4)
        return Codes(q, 0, dl, -ml)  # gguf: dl · q - ml


@register("quantization", "q3_k")
class Q3_KLinear(GGMLLinear):
    """``Q3_K``: 3-bit weights in 16 runs of 16, each with a 6-bit scale (3.4375 bits per weight)."""

    scheme = "q3_k"
    ggml_type = "Q3_K"
    block_size = QK_K
    type_size = 110
    fields = (("hmask", 32, torch.uint8), ("qs", 64, torch.uint8), ("scales", 12, torch.uint8),
              ("d", 2, torch.float16))
    #: as ``Q2_K``; the third bit of weight 32·i + j is bit i of ``hmask`` byte j (set: no offset; clear: -4).
    block_shape = (2, 4, 2, 16)
    has_quantizer = False
    #: the 16 6-bit scales (offset 32) one byte each: unpacking them in every product would cost more than the
    #: 4 bytes per 256 weights they add (and makes inductor store the products rather than fuse them).
    unpacked_fields = {"scales": 16}

    @classmethod
    def unpack_field(cls, name: str, field: Tensor) -> Tensor:
        # Scale i: low 4 bits in byte i % 8 (nibble i // 8), high 2 bits in byte 8 + i % 4 (bits 2·(i // 4)).
        low = torch.cat([field[..., :8] & 15, field[..., :8] >> 4], dim=-1)
        high = torch.cat([(field[..., 8:] >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
        return low | (high << 4)

    @classmethod
    def pack_field(cls, name: str, state: Tensor) -> Tensor:
        low = (state[..., :8] & 15) | ((state[..., 8:] & 15) << 4)
        high = sum(((state[..., 4 * p:4 * p + 4] >> 4) & 3) << (2 * p) for p in range(4))
        return torch.cat([low, high.to(torch.uint8)], dim=-1)

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        low = layout.bits(layout.field(packed["qs"], 2, 1, 2, 16), (4, 1, 1), 2, 3)
        high = layout.bits(layout.field(packed["hmask"], 1, 1, 2, 16), (2, 4, 1, 1), 1, 1)
        q = low + high * 4  # gguf's q + 4, in [0, 7]: -4 where the bit is clear
        scale = _f32(layout.field(packed["scales"], 2, 4, 2, 1)) - 32.0  # gguf: float(scale - 32), exact
        dl = _f32(layout.field(packed["d"], 1, 1, 1, 1)) * scale
        return Codes(q, 4, dl)  # gguf: (d · scale) · float(low - 4 · (1 - bit))


def _k_runs(packed: dict[str, Tensor], q: Tensor, layout: BlockLayout) -> Codes:
    """``Q4_K`` / ``Q5_K`` weights from their integers ``q`` (``block_shape`` (4, 2, 2, 16)): gguf's
    ``(d · scale) · q - dmin · min`` per run of 32."""
    scales = packed["scales"].view(layout.rows, layout.blocks, 2, 8)  # 8 scales, then 8 minimums
    scale = _f32(layout.field(packed["d"], 1, 1, 1, 1)) * _f32(layout.small(scales[:, :, 0], 4, 2, 1, 1))
    offset = _f32(layout.field(packed["dmin"], 1, 1, 1, 1)) * _f32(layout.small(scales[:, :, 1], 4, 2, 1, 1))
    return Codes(q, 0, scale, -offset)


class _KScales:
    """The 12 bytes of 6-bit scales and minimums of ``Q4_K`` / ``Q5_K`` kept unpacked, one byte each (8 scales,
    then 8 minimums): unpacking them in every product would cost more than the 4 bytes per 256 weights they add
    (and makes inductor store the products rather than fuse them). llama.cpp's ``get_scale_min_k4``: runs 0-3 in
    the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); runs 4-7 with their low 4 bits in the nibbles of bytes
    8-11 and their high 2 bits in the top bits of bytes 0-3 and 4-7."""

    unpacked_fields = {"scales": 16}

    @classmethod
    def unpack_field(cls, name: str, field: Tensor) -> Tensor:
        d, m, md = field[..., 0:4], field[..., 4:8], field[..., 8:12]
        sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
        mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
        return torch.cat([sc, mn], dim=-1)

    @classmethod
    def pack_field(cls, name: str, state: Tensor) -> Tensor:
        sc, mn = state[..., :8], state[..., 8:]
        d = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
        m = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
        return torch.cat([d, m, (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], dim=-1)


@register("quantization", "q4_k")
class Q4_KLinear(_KScales, GGMLLinear):
    """``Q4_K``: 4-bit weights in 8 runs of 32, each with a 6-bit scale and minimum (4.5 bits per weight)."""

    scheme = "q4_k"
    ggml_type = "Q4_K"
    block_size = QK_K
    type_size = 144
    fields = (("d", 2, torch.float16), ("dmin", 2, torch.float16), ("scales", 12, torch.uint8),
              ("qs", 128, torch.uint8))
    #: (pair, nibble, half, weight): run 2·pair + nibble is that nibble of bytes 32·pair .. 32·pair + 31.
    block_shape = (4, 2, 2, 16)
    #: the halves outside the nibbles: the compiled product's loops then convert 16 bytes at a time.
    fused_order = (0, 2, 1, 3)
    has_quantizer = False

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        return _k_runs(packed, layout.bits(layout.field(packed["qs"], 4, 1, 2, 16), (2, 1, 1), 4, 15), layout)


@register("quantization", "q5_k")
class Q5_KLinear(_KScales, GGMLLinear):
    """``Q5_K``: 5-bit weights in 8 runs of 32, each with a 6-bit scale and minimum (5.5 bits per weight)."""

    scheme = "q5_k"
    ggml_type = "Q5_K"
    block_size = QK_K
    type_size = 176
    fields = (("d", 2, torch.float16), ("dmin", 2, torch.float16), ("scales", 12, torch.uint8),
              ("qh", 32, torch.uint8), ("qs", 128, torch.uint8))
    #: as ``Q4_K``; the fifth bit of weight 32·i + j is bit i of ``qh`` byte j.
    block_shape = (4, 2, 2, 16)
    fused_order = (0, 2, 1, 3)
    has_quantizer = False

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        low = layout.bits(layout.field(packed["qs"], 4, 1, 2, 16), (2, 1, 1), 4, 15)
        high = layout.bits(layout.field(packed["qh"], 1, 1, 2, 16), (4, 2, 1, 1), 1, 1)
        return _k_runs(packed, low + high * 16, layout)


@register("quantization", "q6_k")
class Q6_KLinear(GGMLLinear):
    """``Q6_K``: 6-bit weights (offset 32) in 16 runs of 16, each with an int8 scale (6.5625 bits per weight)."""

    scheme = "q6_k"
    ggml_type = "Q6_K"
    block_size = QK_K
    type_size = 210
    fields = (("ql", 128, torch.uint8), ("qh", 64, torch.uint8), ("scales", 16, torch.int8),
              ("d", 2, torch.float16))
    #: (half, nibble, pair, run of 16, weight): weight 128·half + 64·nibble + 32·pair + j has its low 4 bits in
    #: ``ql`` byte 64·half + 32·pair + j (that nibble) and its high 2 bits in ``qh`` byte 32·half + j, bits
    #: 2·(2·nibble + pair).
    block_shape = (2, 2, 2, 2, 16)
    has_quantizer = False

    @classmethod
    def codes(cls, packed: dict[str, Tensor], layout: BlockLayout) -> Codes:
        low = layout.bits(layout.field(packed["ql"], 2, 1, 2, 2, 16), (2, 1, 1, 1), 4, 15)
        high = layout.bits(layout.field(packed["qh"], 2, 1, 1, 2, 16), (2, 2, 1, 1), 2, 3)
        scale = _f32(layout.field(packed["d"], 1, 1, 1, 1, 1)) * _f32(layout.field(packed["scales"], 2, 2, 2, 2, 1))
        return Codes(low + high * 16, 32, scale)  # gguf: (d · scale) · float(q - 32)


#: GGUF tensor type name -> registered scheme name.
SCHEMES: dict[str, str] = {
    cls.ggml_type: cls.scheme
    for cls in (Q8_0Linear, Q4_0Linear, Q4_1Linear, Q5_0Linear, Q5_1Linear, Q2_KLinear, Q3_KLinear, Q4_KLinear,
                Q5_KLinear, Q6_KLinear)
}
