"""How large the engine's paged KV cache may grow by default: ``max_num_seqs`` full contexts, at most a fraction of
the memory available when the engine starts.

The pools grow with the blocks in use (doubling, ``blocks.paged_cache``), in eager and compiled steps alike, so this
is a limit, not an allocation: a lone short request holds a few blocks whatever the limit. The limit matters when
the cache fills (the scheduler then preempts the latest request), and keeps a model of a huge context (a
``max_len`` of 128k positions) from promising sixteen such contexts that the machine could never hold.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: The share of the memory available at start (``available_memory``) that the KV cache may grow to by default.
DEFAULT_MEMORY_FRACTION = 0.5


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes that can be allocated now on ``device``: free memory of a CUDA device, else the host's
    ``MemAvailable`` (``/proc/meminfo``), else its free physical pages.

    Returns:
        A positive number of bytes.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_num_blocks(block_bytes: int, block_size: int, max_num_seqs: int, context: int, *,
                       available: int | None = None, fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """The engine's default cache size in blocks: ``max_num_seqs`` contexts of ``context`` positions, at most
    ``fraction`` of ``available`` bytes, and never less than one full context (a request as long as the context must
    fit; the pools still grow only as blocks are used).

    Args:
        block_bytes: bytes of one block over every layer (``serving.engine.kv_block_nbytes``).
        block_size: positions per block.
        max_num_seqs: sequences in one step at most.
        context: positions of one context (``max_model_len``).
        available: bytes available (default: ``available_memory()``, on the CPU).
        fraction: the share of ``available`` the cache may take, in ``(0, 1]``.

    Returns:
        A number of blocks >= ``ceil(context / block_size)``.

    Raises:
        ValueError: ``fraction`` outside ``(0, 1]`` or a non-positive size.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    for name, value in (("block_bytes", block_bytes), ("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("context", context)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    per_context = -(-context // block_size)
    budget = int((available_memory() if available is None else available) * fraction) // block_bytes
    return min(max_num_seqs * per_context, max(per_context, budget))


def engine_cache_blocks(model: Any, block_size: int, max_num_seqs: int, context: int, block_bytes: int) -> int:
    """``default_num_blocks`` for ``model`` on its device (the memory of its first parameter's device)."""
    device = next(model.parameters()).device
    return default_num_blocks(block_bytes, block_size, max_num_seqs, context, available=available_memory(device))
