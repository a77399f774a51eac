"""What ``zoo serve`` says before it loads the weights: the one log line naming what the engine is given."""

from __future__ import annotations

import argparse
from typing import Any


def startup_line(name: str, model: Any, args: argparse.Namespace, limits: dict[str, Any]) -> str:
    """``serving NAME from MODEL: dtype float32 on cpu, context 2048 tokens, KV cache 2048 blocks of 16 positions
    (96.0 MiB), 16 sequences at most, 2 threads, compile off`` (an embedding model: no KV cache), and how many
    linear weights ``prepack_weights`` will hold prepacked (none said: none).

    Args:
        name: the served model name.
        model: the loaded model (its weights may be on the meta device).
        args: the parsed ``zoo serve`` options (``model``, ``device``, ``threads``).
        limits: the ``Engine`` arguments (``max_num_seqs``, ``num_blocks``, ``block_size``, ``kv_cache_bytes``,
            ``max_model_len``, ``compile``, ``kv_cache_dtype``, ``prepack_weights``).

    Returns:
        The line.
    """
    import torch

    from blocks.prepacked_linear import prepackable

    from .cache_size import default_num_blocks, resolve_kv_cache_dtype
    from .engine import blocks_in_memory, kv_block_nbytes

    dtype = str(next(iter(model.parameters())).dtype).removeprefix("torch.")
    where = f"dtype {dtype} on {getattr(args, 'device', None) or 'cpu'}"
    threads = f"{torch.get_num_threads()} threads"
    if getattr(model.config, "head", None) == "embedding":
        return f"serving {name!r} from {args.model}: embeddings, {where}, {threads}"
    context = limits.get("max_model_len") or model.config.max_len
    block = limits["block_size"]
    blocks = limits.get("num_blocks")
    try:
        kv_dtype = resolve_kv_cache_dtype(limits.get("kv_cache_dtype", "auto"))
        per_block = kv_block_nbytes(model, block, kv_dtype)
        if limits.get("kv_cache_bytes") is not None:
            blocks = blocks_in_memory(model, limits["kv_cache_bytes"], block, blocks, kv_dtype)
        elif blocks is None:  # as the engine sizes its default cache (within the device's share of its memory)
            device = torch.device(getattr(args, "device", None) or "cpu")
            blocks = default_num_blocks(per_block, block, limits["max_num_seqs"], context, device)
            if not limits.get("max_model_len"):
                context = min(context, blocks * block)
        kv = f"KV cache {blocks} blocks of {block} positions ({blocks * per_block / 2**20:.1f} MiB"
        kv += ")" if kv_dtype is None else f", {str(kv_dtype).removeprefix('torch.')})"
    except (ValueError, NotImplementedError, AttributeError):
        kv = "KV cache: see the engine's error"
    compiled = {True: "on", False: "off"}.get(limits.get("compile"), limits.get("compile"))
    on_cpu = torch.device(getattr(args, "device", None) or "cpu").type == "cpu"  # (others are not prepacked)
    packed = len(prepackable(model)) if limits.get("prepack_weights") and on_cpu else 0
    return (f"serving {name!r} from {args.model}: {where}, context {context} tokens, {kv}, "
            f"{limits['max_num_seqs']} sequences at most, {threads}, compile {compiled}"
            + (f", {packed} linear weights prepacked" if packed else ""))
