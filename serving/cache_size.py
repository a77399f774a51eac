"""How many paged-cache blocks an engine takes by default: as many as its sequences' full contexts need, but never
more than the machine can hold — a config's ``max_position_embeddings`` of 1e12 is a number, not a cache size.

The memory a default cache may take is a fraction of what is available now on the model's device: half of the
host's available memory (``MemAvailable``, within the cgroup's limit) for a CPU model, 90 % of the free memory of a
CUDA device. A number of blocks asked for explicitly is refused when even the whole device could not hold it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .runner import block_nbytes, float_like, paged_kind

#: The share of the available memory a default cache may take (CPU, CUDA).
CPU_SHARE, CUDA_SHARE = 0.5, 0.9
#: Host bytes the block allocator keeps per block (reference count, free-list entry and its int).
ALLOCATOR_BYTES_PER_BLOCK = 64


def _read_int(path: str, key: str | None = None) -> int | None:
    """An integer from a /proc or /sys file (the value after ``key``, in kB when ``key`` is given), else None."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if key is None:
        text = text.strip()
        return int(text) if text.isdigit() else None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def host_memory() -> tuple[int, int]:
    """The host's ``(available, total)`` bytes: ``MemAvailable`` and ``MemTotal``, each within the cgroup's limit
    (``memory.max`` less ``memory.current``) where one is set.

    Returns:
        ``(available, total)`` bytes.
    """
    total = _read_int("/proc/meminfo", "MemTotal")
    available = _read_int("/proc/meminfo", "MemAvailable")
    if total is None:
        page = os.sysconf("SC_PAGE_SIZE")
        total, available = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None:
        total = min(total, limit)
        available = min(available if available is not None else total, max(0, limit - (used or 0)))
    return (available if available is not None else total), total


def device_memory(device: torch.device) -> tuple[int, int]:
    """``(available, total)`` bytes of ``device``: ``torch.cuda.mem_get_info`` for CUDA, else the host's.

    Args:
        device: the device.

    Returns:
        ``(available, total)`` bytes.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return host_memory()


def default_num_blocks(block_nbytes: int, block_size: int, max_num_seqs: int, context: int,
                       device: torch.device) -> int:
    """Blocks of the default cache: ``max_num_seqs`` full contexts, or fewer when they would take more than the
    device's share of its available memory (``CPU_SHARE`` / ``CUDA_SHARE``).

    Args:
        block_nbytes: bytes one block takes on the device (``kv_block_nbytes``).
        block_size: positions per block.
        max_num_seqs: sequences in one step at most.
        context: positions a sequence may reach.
        device: where the cache lives.

    Returns:
        The number of blocks (>= 1).

    Raises:
        ValueError: not even one block fits in the device's share of its available memory.
    """
    wanted = max_num_seqs * -(-context // block_size)
    available, _ = device_memory(device)
    share = CUDA_SHARE if device.type == "cuda" else CPU_SHARE
    per_block = block_nbytes + ALLOCATOR_BYTES_PER_BLOCK * (device.type == "cpu")
    fits = int(available * share) // per_block
    if fits < 1:
        raise ValueError(f"no KV-cache block fits in memory: one block of {block_size} positions takes {per_block} "
                         f"bytes, {share:.0%} of the {available} bytes available on {device} is less; pass "
                         "num_blocks= or kv_cache_bytes= explicitly, or free memory")
    return min(wanted, fits)


def check_num_blocks(num_blocks: int, block_nbytes: int, block_size: int, device: torch.device) -> None:
    """Refuse ``num_blocks`` that even the whole of ``device``'s memory could not hold.

    Args:
        num_blocks: the KV blocks asked for.
        block_nbytes: bytes of one block (every layer's keys and values).
        block_size: positions per block.
        device: where the pools would live.

    Raises:
        ValueError: naming ``num_blocks``, the bytes it needs and the device's total.
    """
    _, total = device_memory(device)
    need = num_blocks * (block_nbytes + ALLOCATOR_BYTES_PER_BLOCK)
    if need > total:
        raise ValueError(f"num_blocks={num_blocks} of {block_size} positions would take {need} bytes; {device} has "
                         f"{total} bytes in all: expected at most {total // (block_nbytes + ALLOCATOR_BYTES_PER_BLOCK)}"
                         " blocks")


def memory_device(model: Any) -> torch.device:
    """The device of ``model``'s first parameter (where its cache will live); CPU for a model without any.

    Args:
        model: the served model.

    Returns:
        The device.
    """
    param = next(iter(model.parameters()), None)
    return torch.device("cpu") if param is None else param.device


def kv_block_nbytes(model: Any, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes of one paged-cache block of ``model``: what ``block_size`` positions hold in every layer (keys and
    values, or latent attention's latents and rotary keys).

    Args:
        model: the ``DecoderLM``.
        block_size: positions per block.
        kv_dtype: the cache's dtype, or None for the model's float dtype.

    Returns:
        The block's bytes.
    """
    return block_nbytes(model, block_size, kv_dtype)


#: ``Engine``'s ``kv_cache_dtype`` values by name ("auto": the model's float dtype).
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(value: Any, model: Any = None) -> torch.dtype | None:
    """``Engine``'s ``kv_cache_dtype``: a name of ``KV_CACHE_DTYPES`` or one of its torch dtypes.

    Args:
        value: ``"auto"``, ``"float32"``, ``"float16"``, ``"bfloat16"``, or ``torch.float32`` / ``float16`` /
            ``bfloat16``.
        model: the ``DecoderLM`` it is for, or None (not checked).

    Returns:
        The dtype, or None for ``"auto"`` (the model's).

    Raises:
        ValueError: any other value.
        NotImplementedError: a dtype other than ``model``'s for a latent-attention model (its cache keeps the
            model's dtype).
    """
    if isinstance(value, torch.dtype) and value in KV_CACHE_DTYPES.values():
        dtype = value
    elif isinstance(value, str) and value in KV_CACHE_DTYPES:
        dtype = KV_CACHE_DTYPES[value]
    else:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))} (or that torch "
                         f"dtype), got {value!r}")
    if (model is not None and dtype not in (None, float_like(model).dtype)
            and any(paged_kind(layer) != "paged" for layer in model.layers)):
        raise NotImplementedError(f"kv_cache_dtype={value!r}: a latent-attention model's cache keeps the model's "
                                  "dtype; expected 'auto'")
    return dtype


def blocks_in_memory(model: Any, nbytes: Any, block_size: int, num_blocks: int | None,
                     kv_dtype: torch.dtype | None = None) -> int:
    """How many blocks ``nbytes`` of KV cache hold (``Engine``'s ``kv_cache_bytes``).

    Args:
        model: the ``DecoderLM``.
        nbytes: the cache's bytes.
        block_size: positions per block.
        num_blocks: the blocks asked for besides (must be None).
        kv_dtype: the cache's dtype, or None for the model's float dtype.

    Returns:
        The number of whole blocks that fit.

    Raises:
        ValueError: ``nbytes`` not a positive integer, given with ``num_blocks``, or less than one block.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"kv_cache_bytes must be a positive integer, got {nbytes!r}")
    if num_blocks is not None:
        raise ValueError(f"give num_blocks={num_blocks} or kv_cache_bytes={nbytes}, not both")
    per_block = kv_block_nbytes(model, block_size, kv_dtype)
    if nbytes < per_block:
        raise ValueError(f"kv_cache_bytes={nbytes} holds no block: one block of {block_size} positions takes "
                         f"{per_block} bytes")
    return nbytes // per_block
