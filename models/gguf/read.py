"""Read GGUF files (llama.cpp's format) as ``transformers`` checkpoints (``models.gguf.export`` writes them).

``read_gguf(path)`` gives what a ``transformers`` folder of the file's family would hold: the ``config.json`` dict,
the state dict under that family's names, and the embedded tokenizer. ``models.from_pretrained("model.gguf")``
passes the first two to ``models.convert.from_transformers``, so a GGUF loads through the same converter (looked up
by ``model_type``) as a ``transformers`` checkpoint of its family: llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2
and t5.

What llama.cpp's converter changed is undone:
- quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K) are dequantized with the
  ``gguf`` package's reference decoders, one tensor at a time; F32, F16 and BF16 tensors are read as they are;
- names, llama's q/k row permutation, Gemma's ``1 + w`` norms and GPT-2's transposed ``Conv1D`` weights
  (``models.gguf.families``);
- Llama 3.1's ``rope_scaling``, which llama.cpp replaces by a ``rope_freqs`` tensor (``models.gguf.rope``).

The file itself (header, metadata, tensor layout) is read and checked by ``models.gguf.file``; split sets
(``-00001-of-0000N.gguf``) are read part by part. The ``gguf`` package is an optional extra
(``pip install transformer-zoo[gguf]``), imported only when a file is read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from tokenization import Tokenizer
from tokenization.gguf import tokenizer_from_gguf

from ..checkpoints.options import parse_dtype
from .families import ROPE_FREQS, hf_checkpoint_layout
from .file import GGUFArray, GGUFFile, TensorInfo, import_gguf, read_gguf_file
from .packed import packable, packed_weight
from .rope import add_llama3_rope_scaling

#: ggml tensor types read here: plain floats, and every block format the gguf package decodes that
#: llama.cpp's quantize writes for these models. (Importance-matrix "IQ" and ternary types are not.)
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

# llama.cpp's split sets: ``name-00001-of-00003.gguf`` (``llama-gguf-split``), with split.* keys in every part.
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
MAX_SPLITS = 9999


def read_gguf(
    path: str | os.PathLike[str], dtype: str | torch.dtype | None = None, *, keep_packed: bool = False
) -> tuple[dict[str, Any], dict[str, Tensor], Tokenizer | None]:
    """Read a GGUF file (llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2 or t5) as a ``transformers`` checkpoint.

    Every check runs before any tensor is decoded or any array is turned into Python objects: the header's
    counts, lengths and tensor layout against the file (``models.gguf.file``), then the architecture, tensor
    types, the sizes the metadata states against the tensors present, names and shapes, and the tokenizer
    lists' lengths against the vocabulary. Tensors are then decoded one at a time from the memory-mapped file, so
    peak memory is the returned tensors plus a few times the largest tensor; a header that claims more than its
    file holds fails in time proportional to the header.

    Args:
        path: a ``.gguf`` file, or the first part of a split set (``model-00001-of-00003.gguf``; the other parts
            are read from the same folder).
        dtype: floating dtype of the returned tensors (``torch.dtype`` or a name such as ``"bfloat16"``).
            Default: float32, which holds every F16/BF16 value and every dequantized value exactly.
        keep_packed: give each 2-d tensor stored in a block format with a registered ``quantization`` scheme
            (``models.gguf.packed.SCHEMES``) as a ``blocks.quantized.PackedWeight`` that loads the file's blocks
            (``models.from_pretrained`` does this unless ``dequantize=True``); otherwise every tensor is decoded.

    Returns:
        ``(config, state_dict, tokenizer)``: a ``transformers`` ``config.json`` dict of the file's family
        (``model_type``, sizes, epsilons, rope settings, ``tie_word_embeddings``, ``bos/eos/pad_token_id``);
        tensors under that family's ``transformers`` names, with llama.cpp's changes undone (see
        ``models.gguf.families``); the embedded tokenizer (a ``tokenization.gguf.GGUFTokenizer``), or None when
        the file has no vocabulary. Shapes: as the ``transformers`` model stores them.

    Raises:
        ImportError: the ``gguf`` package is not installed.
        FileNotFoundError: ``path`` (or a part of its split set) does not exist.
        ValueError: not a GGUF file; a header count, string or array length, tensor dims, type, offset or size
            the file cannot hold (or overlapping tensors); an architecture outside
            ``models.gguf.families.SUPPORTED_ARCHITECTURES``; a tensor type outside ``SUPPORTED_TYPES``; metadata
            sizes that disagree with the tensors; unknown, missing, duplicated or mis-shaped tensors; metadata the
            family's config cannot represent; a split set whose parts disagree. The message names the field.

    Shapes: every tensor as the ``transformers`` model stores it.
    """
    target_dtype = parse_dtype(dtype) or torch.float32
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    files, tensors = read_gguf_parts(path)
    gguf = import_gguf()
    metadata = files[0].metadata
    bad_types = sorted({t.type_name for _, t in tensors.values()} - set(SUPPORTED_TYPES))
    if bad_types:
        which = [name for name, (_, t) in tensors.items() if t.type_name in bad_types][:5]
        raise ValueError(
            f"GGUF tensor type(s) {bad_types} (in {which}) are not supported; expected one of {list(SUPPORTED_TYPES)}"
        )
    shapes = {name: t.shape for name, (_, t) in tensors.items()}
    layout = hf_checkpoint_layout(metadata, shapes, str(files[0].path))
    config = layout.config
    tokenizer_metadata = _tokenizer_metadata(metadata, config["vocab_size"])
    if layout.rope_freqs:
        add_llama3_rope_scaling(config, decode_tensor(gguf, *tensors[ROPE_FREQS]))
    tokenizer = None
    if tokenizer_metadata is not None:  # built before the weights are decoded: its errors come first
        tokenizer = tokenizer_from_gguf(tokenizer_metadata)

    n_kv = config.get("num_key_value_heads")
    state: dict[str, Tensor] = {}
    for gguf_name, (hf_name, change) in layout.names.items():
        file, info = tensors[gguf_name]
        if keep_packed and packable(info) and change in (None, "permute_q", "permute_k"):
            heads = config["num_attention_heads"] if change == "permute_q" else n_kv
            rows = None if change is None else unpermute_rows(torch.arange(info.shape[0]), heads)
            state[hf_name] = packed_weight(file, info, rows, _materializer(gguf, file, info, rows, target_dtype))
            continue
        weight = decode_tensor(gguf, file, info)
        if change == "permute_q":
            weight = unpermute_rows(weight, config["num_attention_heads"])
        elif change == "permute_k":
            weight = unpermute_rows(weight, n_kv)
        elif change == "minus_one":
            weight = weight - 1
        elif change == "transpose":
            weight = weight.T.contiguous()
        state[hf_name] = weight.to(target_dtype)
    return config, state, tokenizer


def _materializer(gguf: Any, file: GGUFFile, info: TensorInfo, rows: Tensor | None, dtype: torch.dtype) -> Any:
    """A function decoding the tensor (rows reordered by ``rows``) to ``dtype``, for ``PackedWeight.materialize``."""

    def materialize() -> Tensor:
        weight = decode_tensor(gguf, file, info)
        return (weight if rows is None else weight[rows]).to(dtype)

    return materialize


def read_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer | None:
    """Only the tokenizer a GGUF file embeds (a ``GGUFTokenizer``), or None when it has no vocabulary.

    Args:
        path: the ``.gguf`` file.

    Returns:
        The tokenizer, or None.

    Raises:
        ValueError: as ``read_gguf`` for the header and the ``tokenizer.*`` metadata.
    """
    file = read_gguf_file(path)
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    if not isinstance(tokens, GGUFArray):
        raise ValueError(f"GGUF metadata tokenizer.ggml.tokens={tokens!r}: expected an array of strings")
    metadata = _tokenizer_metadata(file.metadata, len(tokens))
    return None if metadata is None else tokenizer_from_gguf(metadata)


def read_gguf_parts(path: str | os.PathLike[str]) -> tuple[list[GGUFFile], dict[str, tuple[GGUFFile, TensorInfo]]]:
    """A GGUF file, or every part of a split set, checked; tensor name -> (its file, its description).

    Args:
        path: the file, or the first part of a split set.

    Returns:
        ``(parts, tensors)``: the parts in order, and each tensor's part and description.

    Raises:
        FileNotFoundError: a part of the set is missing.
        ValueError: a part whose ``split.no`` / ``split.count`` disagree with its name or the first part's, a
            tensor stored in two parts, or a total other than ``split.tensors.count``.
    """
    first = read_gguf_file(path)
    count = first.metadata.get("split.count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SPLITS:
        raise ValueError(f"GGUF split.count={count!r} in {str(first.path)!r}: expected 1 to {MAX_SPLITS}")
    files = [first]
    if count > 1:
        match = _SPLIT_NAME.match(first.path.name)
        if match is None or int(match["no"]) != 1 or int(match["count"]) != count:
            raise ValueError(f"GGUF split.count={count} in {str(first.path)!r}, whose name is not the first part "
                             f"of a split set; expected a name ending in -00001-of-{count:05d}.gguf")
        stem = match["stem"]
        files += [read_gguf_file(first.path.with_name(f"{stem}-{no:05d}-of-{count:05d}.gguf"))
                  for no in range(2, count + 1)]
    tensors: dict[str, tuple[GGUFFile, TensorInfo]] = {}
    for index, file in enumerate(files):
        no, part_count = file.metadata.get("split.no", 0), file.metadata.get("split.count", 1)
        if count > 1 and (no != index or part_count != count):
            raise ValueError(f"GGUF part {str(file.path)!r} says split.no={no!r} of split.count={part_count!r}; "
                             f"expected split.no={index} of {count}")
        for name, info in file.tensors.items():
            if name in tensors:
                raise ValueError(f"GGUF tensor {name!r} is stored in both {str(tensors[name][0].path)!r} and "
                                 f"{str(file.path)!r}; expected each tensor once")
            tensors[name] = (file, info)
    total = first.metadata.get("split.tensors.count", len(tensors))
    if count > 1 and total != len(tensors):
        raise ValueError(f"GGUF split.tensors.count={total!r} in {str(first.path)!r}, but the {count} parts hold "
                         f"{len(tensors)} tensors")
    return files, tensors


def _tokenizer_metadata(metadata: Mapping[str, Any], vocab_size: int) -> dict[str, Any] | None:
    """The ``tokenizer.*`` keys with arrays decoded (strings as ``tokenization.StringTable``), after their lengths
    are checked against the vocabulary."""
    if "tokenizer.ggml.tokens" not in metadata:
        return None
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        value = metadata.get(key)
        if value is not None and (not isinstance(value, GGUFArray) or len(value) != vocab_size):
            got = f"{len(value)} entries" if isinstance(value, GGUFArray) else repr(value)
            raise ValueError(f"GGUF metadata {key} has {got}; expected an array of one entry per row of "
                             f"token_embd.weight ({vocab_size})")
    # Arrays of strings (the tokens, the merges) as compact tables: a list of str would cost ~5x their bytes.
    return {key: (value.strings() if value.holds_strings else value.tolist())
            if isinstance(value, GGUFArray) else value
            for key, value in metadata.items() if key.startswith("tokenizer.")}


def decode_tensor(gguf: Any, file: GGUFFile, tensor: TensorInfo) -> Tensor:
    """A tensor's values as float32, in torch's dimension order (ggml lists the fastest dimension first).

    Args:
        gguf: the ``gguf`` package (its ``quants.dequantize``).
        file: the GGUF file.
        tensor: the tensor's entry in it.

    Returns:
        The values.

    Shapes: -> ``tensor.shape``.
    """
    values = gguf.quants.dequantize(file.raw(tensor), gguf.GGMLQuantizationType(tensor.type_id))
    if not values.flags.writeable:  # F32 comes back as a read-only view of the memory-mapped file
        values = values.copy()
    return torch.from_numpy(values).reshape(tensor.shape)


def unpermute_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Undo ``convert_hf_to_gguf.LlamaModel.permute``: per head, interleaved (x0, y0, x1, y1 ...) rows
    back to rotate-half order (x0, x1 ..., y0, y1 ...).

    Args:
        weight: a q or k projection's weight as llama.cpp stores it.
        n_heads: its heads.

    Returns:
        The weight in rotate-half order.

    Shapes: ``(n_heads * d_head, ...)`` in and out.
    """
    rows = weight.shape[0]
    # (H, D/2, 2, ...) -> (H, 2, D/2, ...): the inverse of the converter's reshape(H, 2, D/2).swapaxes(1, 2)
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def permute_rows(weight: Tensor, n_heads: int) -> Tensor:
    """``convert_hf_to_gguf.LlamaModel.permute``: rotate-half rows to llama.cpp's interleaved layout.

    Args:
        weight: a q or k projection's weight.
        n_heads: its heads.

    Returns:
        The permuted weight.

    Shapes: ``(n_heads * d_head, ...)`` in and out.
    """
    rows = weight.shape[0]
    # (H, 2, D/2, ...) -> (H, D/2, 2, ...)
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
