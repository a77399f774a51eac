"""The GGUF block formats, one ``GGMLLinear`` per format (see ``ggml`` for the layout and the kernels): the
32-weight ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` and the K-quants ``q2_k`` ... ``q6_k``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..registry import register
from .ggml import QK_K, GGMLLinear
from .ggml_layout import BlockLayout, Codes, f32


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
        return Codes(layout.field(packed["qs"], 32), 0, f32(layout.field(packed["d"], 1)))  # gguf: x · d


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
        return Codes(q, 8, f32(layout.field(packed["d"], 1, 1)))  # gguf: d · float(q - 8)


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
        return Codes(q, 0, f32(d), f32(m))  # gguf: d · q + m


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
        return Codes(_five_bits(packed, layout), 16, f32(layout.field(packed["d"], 1, 1)))  # gguf: d · float(q - 16)


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
        return Codes(_five_bits(packed, layout), 0, f32(d), f32(m))  # gguf: d · q + m


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
        dl, ml = f32(d) * f32(scales & 15), f32(dmin) * f32(scales >> 4)
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
        scale = f32(layout.field(packed["scales"], 2, 4, 2, 1)) - 32.0  # gguf: float(scale - 32), exact
        dl = f32(layout.field(packed["d"], 1, 1, 1, 1)) * scale
        return Codes(q, 4, dl)  # gguf: (d · scale) · float(low - 4 · (1 - bit))


def _k_runs(packed: dict[str, Tensor], q: Tensor, layout: BlockLayout) -> Codes:
    """``Q4_K`` / ``Q5_K`` weights from their integers ``q`` (``block_shape`` (4, 2, 2, 16)): gguf's
    ``(d · scale) · q - dmin · min`` per run of 32."""
    scales = packed["scales"].view(layout.rows, layout.blocks, 2, 8)  # 8 scales, then 8 minimums
    scale = f32(layout.field(packed["d"], 1, 1, 1, 1)) * f32(layout.small(scales[:, :, 0], 4, 2, 1, 1))
    offset = f32(layout.field(packed["dmin"], 1, 1, 1, 1)) * f32(layout.small(scales[:, :, 1], 4, 2, 1, 1))
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
        scale = f32(layout.field(packed["d"], 1, 1, 1, 1, 1)) * f32(layout.field(packed["scales"], 2, 2, 2, 2, 1))
        return Codes(low + high * 16, 32, scale)  # gguf: (d · scale) · float(q - 32)


#: GGUF tensor type name -> registered scheme name.
SCHEMES: dict[str, str] = {
    cls.ggml_type: cls.scheme
    for cls in (Q8_0Linear, Q4_0Linear, Q4_1Linear, Q5_0Linear, Q5_1Linear, Q2_KLinear, Q3_KLinear, Q4_KLinear,
                Q5_KLinear, Q6_KLinear)
}
