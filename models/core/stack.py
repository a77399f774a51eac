"""Helpers that build and run a stack of layers from a config: layers, norms, positions, caches, the LM loss.

The model classes (``models.decoder_lm``, ``encoder_lm``, ``seq2seq``, ``vit``) compose these; generation takes
``new_caches`` and ``cached_length`` from here.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import blocks
import blocks.layers
from blocks.kv_cache import LayerCache
from blocks.positional import PositionalEncoding


def layer_kwargs(config: Any) -> dict[str, Any]:
    """The keyword arguments of the registered ``encoder``/``decoder`` layer builders, taken from a config.

    Args:
        config: the model's config.

    Returns:
        The builders' shared keyword arguments.
    """
    c = config
    return dict(
        d_model=c.d_model, n_heads=c.n_heads, d_ff=c.d_ff, n_kv_heads=c.n_kv_heads, d_head=c.d_head,
        d_value=c.d_value, dropout=c.dropout, attention_dropout=c.attention_dropout, ffn=c.ffn, norm=c.norm,
        norm_eps=c.norm_eps, sublayer=c.sublayer, attention=c.attention, attention_backend=c.attention_backend,
        bias=c.bias,
    )


def build_norm(config: Any) -> nn.Module:
    """A norm of the config's kind, width ``d_model``, with the config's norm options.

    Args:
        config: the model's config.

    Returns:
        The norm.
    """
    options = config.block_options("norm") if hasattr(config, "block_options") else {}
    return blocks.build("norm", config.norm, d_model=config.d_model, eps=config.norm_eps, **options)


def final_norm(config: Any) -> nn.Module:
    """A norm after the last layer for pre-norm stacks (they leave the residual stream unnormalised),
    the identity for post-norm ones.

    Args:
        config: the model's config.

    Returns:
        The norm, or ``nn.Identity``.
    """
    if config.sublayer in ("pre_norm", "sandwich_norm"):
        return build_norm(config)
    return nn.Identity()


def build_layers(config: Any, builder: str, indices: range, **extra: Any) -> nn.ModuleList:
    """The layers ``indices`` of a stack, each built by the registered ``layer`` builder with its block options
    (``config.options`` with ``config.layer_options[i]`` merged over them).

    Args:
        config: the model's config.
        builder: the registered ``layer`` builder (``encoder``, ``decoder``, ``parallel``).
        indices: the layers' indices in ``layer_options`` (Seq2Seq: the encoder's, then the decoder's).
        **extra: more builder arguments (``cross_attention=...``).

    Returns:
        The layers.
    """
    layers = []
    for i in indices:
        options = {kind: config.block_options(kind, i) for kind in blocks.layers.LAYER_OPTION_KINDS}
        layers.append(blocks.build(
            "layer", builder, **layer_kwargs(config), options={k: v for k, v in options.items() if v},
            **config.block_options("layer", i), **extra,
        ))
    return nn.ModuleList(layers)


#: ``[on, mode]``: whether ``layer_call`` runs layers as nested compile regions, and the context each region enters
#: (set by ``repeated_layer_regions``).
_REGIONS: list[Any] = [False, contextlib.nullcontext]


@contextlib.contextmanager
def repeated_layer_regions(enabled: bool = True, mode: Callable[[], Any] = contextlib.nullcontext) -> Iterator[None]:
    """While ``torch.compile`` traces inside this context, ``layer_call`` runs every layer as one
    ``torch.compiler.nested_compile_region``: dynamo traces each distinct layer structure once, inductor compiles it
    once, and every other layer of that structure reuses the code with its own weights (a 30-layer step compiles
    about as fast as a one-layer step). The weights must be graph inputs: inductor's ``freezing`` (weights as
    constants) cannot share a region between layers. A region is traced apart from its caller, so a
    ``TorchFunctionMode`` active around the call does not reach inside: ``mode()`` makes the context every region
    runs in (e.g. ``blocks.small_matmul.SmallRowsLinear``).

    Args:
        enabled: run layers as regions (False: as plain calls, inside a caller's context).
        mode: a factory of the context each region runs in.

    Yields:
        Nothing; the setting holds inside the ``with`` block.
    """
    before = list(_REGIONS)
    _REGIONS[:] = [enabled, mode]
    try:
        yield
    finally:
        _REGIONS[:] = before


# Up to one region per layer: a stack whose layers all differ (per-layer options) compiles as it would without regions
# instead of raising at torch's default limit of 8 structures.
@torch.compiler.nested_compile_region(max_reuse_entries=1024)
def _layer_region(layer: nn.Module, x: Tensor, **kwargs: Any) -> Any:
    with _REGIONS[1]():
        return layer(x, **kwargs)


def _regional_layer(layer: nn.Module, x: Tensor, *, positions: Tensor | None = None, **kwargs: Any) -> Any:
    # A region's inputs may not alias each other: the query positions are a view of the key positions.
    return _layer_region(layer, x, positions=None if positions is None else positions.clone(), **kwargs)


def layer_call(layer: nn.Module) -> Callable[..., Any]:
    """``layer``, or inside ``repeated_layer_regions`` while ``torch.compile`` traces, the same call as a nested
    compile region shared by every layer of its structure.

    Args:
        layer: a decoder or encoder layer.

    Returns:
        A callable with the layer's signature.
    """
    if _REGIONS[0] and torch.compiler.is_compiling():
        return functools.partial(_regional_layer, layer)
    return layer


def build_positional(config: Any, causal: bool, layer: int | None = None) -> PositionalEncoding:
    """The config's positional encoding for a causal or bidirectional stack, with its options (of ``layer``).

    Args:
        config: the model's config.
        causal: the stack is causal (decoder) or bidirectional (encoder).
        layer: the layer whose ``layer_options`` apply, or None for the stack's own.

    Returns:
        The positional encoding.
    """
    return blocks.build(
        "positional", config.positional, d_model=config.d_model, n_heads=config.n_heads, d_head=config.d_head,
        max_len=config.max_len, causal=causal, **config.block_options("positional", layer),
    )


def layer_positionals(config: Any, indices: range, causal: bool) -> nn.ModuleDict:
    """Positional encodings of the layers whose ``layer_options`` change the positional options (e.g. ModernBERT's
    local layers rotate with another base), keyed by the layer's index in its stack. They act inside attention
    only (``rotate``, ``attention_bias``); what the stack's encoding adds to the embeddings is not repeated.

    Args:
        config: the model's config.
        indices: the stack's layer indices in ``layer_options``.
        causal: the stack is causal.

    Returns:
        Index in the stack (as a string) -> positional encoding.
    """
    out = {}
    for j, i in enumerate(indices):
        if config.layer_options and config.layer_options[i].get("positional"):
            out[str(j)] = build_positional(config, causal, i)
    return nn.ModuleDict(out)


def positional_per_layer(
    stack: PositionalEncoding, overrides: nn.ModuleDict, n_layers: int, positions: Tensor, key_positions: Tensor
) -> list[tuple[PositionalEncoding | None, Tensor | None]]:
    """``(rotary, attention bias)`` for each layer of a stack; each distinct encoding's bias is computed once.

    Args:
        stack: the stack's positional encoding.
        overrides: per-layer encodings (``layer_positionals``).
        n_layers: layers in the stack.
        positions: the new queries' positions.
        key_positions: every key's position.

    Returns:
        One ``(rotary or None, bias or None)`` per layer.

    Shapes: positions ``(B, Lq)``, key_positions ``(B, Lk)`` -> biases ``(B|1, H, Lq, Lk)``.
    """
    computed: dict[int, tuple[PositionalEncoding | None, Tensor | None]] = {}
    out = []
    for i in range(n_layers):
        pos = overrides[str(i)] if str(i) in overrides else stack
        if id(pos) not in computed:
            computed[id(pos)] = (pos if pos.rotates else None, pos.attention_bias(positions, key_positions))
        out.append(computed[id(pos)])
    return out


def embedding_scale(config: Any) -> float:
    """``sqrt(d_model)`` with ``scale_embeddings`` (§3.4, Gemma), else 1.

    Args:
        config: the model's config.

    Returns:
        The factor.
    """
    return math.sqrt(config.d_model) if config.scale_embeddings else 1.0


#: A plain linear head at least this wide is multiplied in pieces of ``HEAD_PIECE`` outputs in eager CPU inference
#: of 2 or more rows (``head_logits``): BLAS multiplies one wide product slower than its pieces. Measured on 2 CPU
#: cores, fp32, 1 or 2 threads: GPT-2's 50257 × 768 head 1.22–1.59× faster in pieces at 4–512 rows, SmolLM2's
#: 49152 × 576 1.07–1.31×, a 32000 × 4096 head 1.37–1.56×; 1 row and a 2048-wide head are slower in pieces.
WIDE_HEAD, HEAD_PIECE = 16384, 1024


def head_logits(config: Any, head: nn.Module, x: Tensor) -> Tensor:
    """Vocabulary logits from the final hidden states: ``output_scale`` before the head (T5's tied head),
    ``logit_softcap`` after it (Gemma 2: ``cap · tanh(logits / cap)``).

    Args:
        config: the model's config.
        head: the output projection.
        x: the final hidden states.

    Returns:
        The logits.

    Shapes: x ``(..., d_model)`` -> ``(..., vocab_size)``.
    """
    if config.output_scale != 1.0:
        x = x * config.output_scale
    logits = _in_pieces(head, x) if _wide_eager_head(head, x) else head(x)
    if config.logit_softcap is not None:
        logits = torch.tanh(logits / config.logit_softcap) * config.logit_softcap
    return logits


def _wide_eager_head(head: nn.Module, x: Tensor) -> bool:
    """Whether ``head(x)`` is a product ``_in_pieces`` may run: an exact ``nn.Linear`` (not an adapter, a quantized
    or a parallel layer) without hooks, at least ``WIDE_HEAD`` wide, on the CPU, 2 or more rows, no gradient, not
    inside a compiled graph."""
    return (type(head) is nn.Linear and head.out_features >= WIDE_HEAD and x.device.type == "cpu"
            and x.numel() >= 2 * x.shape[-1] and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not (head._forward_hooks or head._forward_pre_hooks))


def _in_pieces(head: nn.Linear, x: Tensor) -> Tensor:
    """``head(x)`` computed ``HEAD_PIECE`` outputs at a time."""
    biases = [None] * -(-head.out_features // HEAD_PIECE) if head.bias is None else head.bias.split(HEAD_PIECE)
    pieces = [nn.functional.linear(x, w, b) for w, b in zip(head.weight.split(HEAD_PIECE), biases, strict=True)]
    return torch.cat(pieces, dim=-1)


def positions_from_mask(mask: Tensor | None, past: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Positions of the new queries and of all keys.

    With a padding mask ``(B, past + length)`` positions count real tokens only, so a left- or
    right-padded row gets the same positions as the sequence alone; without one, they are
    ``past .. past + length - 1``.

    Args:
        mask: the padding mask of cached and new tokens, or None.
        past: positions already cached.
        length: new tokens.
        device: where to build the positions.

    Shapes: mask ``(B, past + length)``.

    Returns:
        ``(query_positions (B|1, length), key_positions (B|1, past + length))``, long.
    """
    if mask is None:
        keys = torch.arange(past + length, device=device)[None]
    else:
        keys = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return keys[:, past:], keys


def new_caches(layers: int | Sequence[nn.Module], max_len: int, cross: bool = False) -> list[LayerCache]:
    """One empty ``LayerCache`` per decoder layer, preallocating ``max_len`` positions.

    Args:
        layers: the model's layers (each self-attention's ``cache_kind`` picks its registered ``kv_cache`` kind:
            latent attention caches latents) or their number (contiguous per-head caches).
        max_len: positions to preallocate.
        cross: add cross-attention caches (encoder-decoders).

    Returns:
        The caches.
    """
    if isinstance(layers, int):
        return [LayerCache(max_len, cross=cross) for _ in range(layers)]
    return [LayerCache(max_len, cross=cross, kind=getattr(layer.self_attn, "cache_kind", "contiguous"))
            for layer in layers]


def cached_length(cache: list[LayerCache] | None) -> int:
    """Number of positions already in a decoder cache (0 without one).

    Args:
        cache: the model's caches, or None.

    Returns:
        The count.
    """
    return 0 if not cache else cache[0].self_attn.length


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over positions whose label is not -100.

    With every label ignored (an empty micro-batch) the loss is 0 with zero gradient, not NaN, so one such batch
    cannot poison a run.

    Args:
        logits: the predictions.
        labels: target ids, -100 where ignored (already aligned with ``logits``).

    Returns:
        The mean loss, a scalar.

    Shapes: logits ``(..., vocab_size)``, labels ``(...)`` -> ``()``.

    Raises:
        ValueError: labels that are not integers, or ids outside ``[0, vocab_size)`` other than -100 (named).
    """
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must hold integer token ids (or -100), got dtype {labels.dtype}")
    vocab = logits.shape[-1]
    flat_logits, flat_labels = logits.reshape(-1, vocab).float(), labels.reshape(-1)
    kept = flat_labels != -100
    if not torch.compiler.is_compiling():  # (reads tensor data: one host sync, skipped inside a compiled graph)
        outside = kept & ((flat_labels < 0) | (flat_labels >= vocab))
        if bool(outside.any()):
            bad = int(flat_labels[outside][0])
            raise ValueError(f"labels contain {bad}, outside the vocabulary [0, vocab_size={vocab}) and not -100")
    total = nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    return total / kept.sum().clamp(min=1)
