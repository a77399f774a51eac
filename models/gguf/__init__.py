"""GGUF, llama.cpp's file format: reading (``read``), the header and tensor layout (``file``), the architectures
(``families``), Llama 3.1's rope (``rope``), writing (``export``) and keeping quantized blocks packed (``packed``).

``models.from_pretrained("model.gguf")`` reads a file through ``read_gguf`` (registered here as the ``.gguf`` file
format) and converts it like a ``transformers`` checkpoint of its family. Quantized tensors stay in their block
format (``blocks.quantized.ggml``: the layers that multiply by them) unless ``dequantize=True`` is asked for.
"""

from __future__ import annotations

from ..checkpoints.loading import register_file_format
from .read import (
           SUPPORTED_TYPES,
           decode_tensor,
           permute_rows,
           read_gguf,
           read_gguf_parts,
           read_gguf_tokenizer,
           unpermute_rows,
)

__all__ = ["SUPPORTED_TYPES", "decode_tensor", "permute_rows", "read_gguf", "read_gguf_parts", "read_gguf_tokenizer",
           "unpermute_rows"]

# ``models.from_pretrained("model.gguf")``: read_gguf is looked up here when a file is loaded (tests replace it).
register_file_format(
    ".gguf", "GGUF", lambda path, dtype, keep_packed: read_gguf(path, dtype=dtype, keep_packed=keep_packed),
    requires="models.gguf and the gguf package (pip install 'transformer-zoo[gguf]')",
)
