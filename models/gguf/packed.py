"""Quantized GGUF tensors kept in their block format: the ``PackedWeight`` stand-ins ``read_gguf`` hands the loader.

A 2-d tensor stored in a block format that ``blocks.quantized.ggml`` implements (``Q8_0``, ``Q4_0`` ... ``Q6_K``)
is not decoded: the state dict gets a ``PackedWeight`` (a meta-device stand-in of the float weight's shape) that
the converters pass along under the zoo's name, and the loader gives that layer the scheme's packed tensors, read
from the file when the layer is loaded. The file's bytes are read with ordinary reads, not through the memory map,
so the process holds each tensor once (its packed form) and never the mapped pages beside it. Llama's q/k row
permutation (``read.unpermute_rows``) reorders whole rows of blocks, so it is undone on the packed rows exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import blocks
from blocks.quantized import PackedWeight

from .file import GGUFFile, TensorInfo

#: GGUF tensor type name -> the ``quantization`` scheme that keeps it packed.
SCHEMES = {name.upper(): name for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
                                           "q6_k")}


def packable(tensor: TensorInfo) -> bool:
    """Whether ``tensor`` can stay packed: a 2-d tensor in a block format with a registered scheme.

    Args:
        tensor: the tensor's entry in the file.

    Returns:
        True when it can.
    """
    scheme = SCHEMES.get(tensor.type_name)
    return len(tensor.shape) == 2 and scheme is not None and scheme in blocks.names("quantization")


#: Bytes of blocks read and split per chunk by ``read_state``: the most a load holds beside the packed tensors. Kept
#: under glibc's initial mmap threshold (128 KiB): freeing a larger buffer raises that threshold, after which the
#: packed tensors come from the heap between freed chunks, and ~40 MiB of freed memory stayed resident on SmolLM2.
CHUNK_BYTES = 64 << 10


def read_state(file: GGUFFile, tensor: TensorInfo, layer_class: Any, rows: Tensor | None = None
               ) -> dict[str, Tensor]:
    """The layer's packed tensors of a GGUF tensor, read in chunks of whole rows (``CHUNK_BYTES``) and split into
    the fields as they come: the process never holds the tensor's bytes twice (a whole-tensor read split into
    fields would, and the allocator keeps such freed buffers resident).

    Args:
        file: the GGUF file.
        tensor: the tensor's entry in it.
        layer_class: the scheme's layer class (``blocks_to_state``).
        rows: ``new row i = stored row rows[i]``, or None.

    Returns:
        ``state_names`` -> tensor, as ``layer_class.blocks_to_state`` of the whole (reordered) tensor.

    Raises:
        ValueError: the file ends inside the tensor (it changed since its header was checked).

    Shapes: rows ``(out,)`` long.
    """
    n = tensor.shape[0]
    row_bytes = tensor.nbytes // n
    step = max(1, CHUNK_BYTES // row_bytes)
    target = None if rows is None else torch.empty_like(rows).scatter_(0, rows, torch.arange(n))  # stored -> new
    state: dict[str, Tensor] = {}
    with open(file.path, "rb") as f:
        f.seek(tensor.start)
        for first in range(0, n, step):
            count = min(step, n - first)
            raw = torch.empty((count, row_bytes), dtype=torch.uint8)
            if f.readinto(memoryview(raw.numpy()).cast("B")) != count * row_bytes:
                raise ValueError(f"GGUF file {str(file.path)!r} ended inside tensor {tensor.name!r}")
            for name, part in layer_class.blocks_to_state(raw).items():
                if name not in state:
                    state[name] = part.new_empty((n, *part.shape[1:]))
                if target is None:
                    state[name][first:first + count] = part
                else:
                    state[name][target[first:first + count]] = part
    return state


def packed_weight(file: GGUFFile, tensor: TensorInfo, rows: Tensor | None, materialize: Any) -> PackedWeight:
    """A ``PackedWeight`` for ``tensor`` (``packable``), its rows reordered by ``rows`` (indices) when given.

    Args:
        file: the GGUF file holding the blocks.
        tensor: the tensor's entry in that file (offset, type, shape).
        rows: ``new row i = stored row rows[i]``, or None.
        materialize: returns the float32 weight (with the same reordering), for a converter that changes it.

    Returns:
        The stand-in (on the meta device).

    Shapes: rows ``(out,)`` long -> a stand-in of the float weight's ``(out, in)``.
    """
    scheme = SCHEMES[tensor.type_name]
    layer_class = blocks.get("quantization", scheme)

    def load_state() -> dict[str, Tensor]:
        return read_state(file, tensor, layer_class, rows)

    return PackedWeight.make(tuple(tensor.shape), scheme, load_state, materialize)
