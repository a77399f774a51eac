"""Weight-only quantization: one registered ``quantization`` kind, one contract (``QuantizedLinear``).

Schemes: ``int8`` (per output channel), ``int4`` (group-wise), and the GGUF block formats (``q8_0``, ``q4_0``,
``q4_1``, ``q5_0``, ``q5_1``, ``q4_k``, ``q5_k``, ``q6_k`` ...), each in its own module; ``surgery`` swaps a model's
layers for quantized ones and back.
"""

from . import ggml_formats, int4, int8  # noqa: F401  (registers the schemes)
from .base import CHUNK_ELEMENTS, PackedWeight, QuantizedEmbedding, QuantizedLinear
from .int4 import Int4Linear
from .int8 import Int8Linear
from .joint import joint_linear
from .surgery import (
    check_unquantized,
    dequantize_linears,
    packable_schemes,
    quantization_mismatch,
    quantization_options,
    quantize_linears,
    quantized_modules,
    quantized_skeleton,
    scheme_of,
    state_names_of,
)

__all__ = [
    "CHUNK_ELEMENTS", "Int4Linear", "Int8Linear", "PackedWeight", "QuantizedEmbedding", "QuantizedLinear",
    "check_unquantized", "dequantize_linears", "joint_linear", "packable_schemes", "quantization_mismatch",
    "quantization_options", "quantize_linears",
    "quantized_modules", "quantized_skeleton", "scheme_of", "state_names_of",
]
