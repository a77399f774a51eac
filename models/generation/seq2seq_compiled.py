"""A compiled, static-shape decode step for ``Seq2SeqTransformer.generate(..., compile=True)``.

The encoder runs once, eagerly (``generate`` does that for both paths). The first decoder step (the start token)
also runs eagerly over an ordinary cache: it computes every layer's cross-attention keys/values once. Its
contents are then copied into buffers whose shapes never change, and every later step runs one compiled graph
(``models.generation.compiled.compile_step``: inductor on CPU, CUDA graphs on CUDA) over them:

- decoder self-attention uses a ``BucketKVCache`` of ``bucket`` slots (powers of two from ``MIN_BUCKET``), with the
  write slot a long tensor and the visible slots a ``(R, bucket)`` mask, both updated in place between steps. As
  for ``DecoderLM`` (``compiled.first_bucket``), a loop starts in the bucket holding the start token and
  ``steps.CACHE_CHUNK`` new tokens and moves to one twice as long when it is full, so memory follows the tokens
  really generated, not ``max_new_tokens``; each bucket reached compiles the step once;
- cross-attention keys/values live in a ``(R, Hkv, source_bucket, D)`` buffer per layer, the slots past the real
  source hidden by the memory mask, so sources of different lengths in one bucket reuse the graph;
- beam search keeps ``R = B · num_beams`` rows for the whole search: source ``s`` owns rows
  ``s·num_beams … s·num_beams + num_beams − 1``. Which beams survive a step is a
  ``(R,)`` long tensor ``perm`` (new row ``r`` continues old row ``perm[r]``), applied inside the graph to the
  self-attention buffers in place (``copy_`` of an ``index_select``). Beams never change sources, so the
  cross-attention buffers are never reordered; rows of sources that have finished keep computing (their
  logits are dropped) instead of changing the batch size, so the same graph serves every step of every call.

Token choice (greedy, sampling, repetition penalty, the beam bookkeeping of ``models.generation.beam_search``) runs
outside the graph on the step's logits. The buffers of a ``(model, rows, bucket, source bucket)`` are kept for later
calls, so that the graph's guards (which check the objects it reads) keep holding. Each set belongs to one decoding
loop while that loop's step function lives: a ``stream`` left open while another compiled call of the same shapes
runs gets a set of its own (the buffers hold the loop's cache), never one that is in use.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from blocks.kv_cache import BucketKVCache, LayerCache, StaticKVCache

from ..core import stack
from .beam_search import StepFn
from .compiled import bucket_length, compile_step, first_bucket, grown_bucket

# Per model: {(rows, bucket, source bucket, dtype, device): [_Static, ...]} — reused so that the graph's guards
# hold; more than one set only while several loops of those shapes are open at once (streams).
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class _Static:
    """The fixed-shape inputs of the compiled step (``R`` rows)."""

    caches: list[LayerCache]  # self_attn: BucketKVCache (R, Hkv, bucket, D); cross_attn: filled (R, Hkv, Sb, D)
    self_mask: Tensor  # (R, bucket) bool, True = slot written (the current one included)
    index: Tensor  # (1,) long, the slot the step writes
    memory: Tensor  # (R, Sb, d_model) zero-stride placeholder: cross K/V are cached, only the shape is read
    memory_mask: Tensor  # (R, Sb) bool, True = real source token
    perm: Tensor  # (R,) long, the beam reorder of this step
    owner: weakref.ref | None = None  # the step function decoding with these buffers; free once it is dead

    def free(self) -> bool:
        return self.owner is None or self.owner() is None


def _step(
    model: Any,
    tokens: Tensor,
    self_mask: Tensor,
    caches: list[LayerCache],
    memory: Tensor,
    memory_mask: Tensor,
    perm: Tensor | None,
) -> Tensor:
    """Reorder the self-attention buffers by ``perm`` (beam search), then decode one token per row.

    Shapes: tokens ``(R, 1)``, self_mask ``(R, bucket)``, memory_mask ``(R, Sb)``, perm ``(R,)`` -> ``(R, V)``.
    """
    if perm is not None:
        for layer_cache in caches:
            kv = layer_cache.self_attn
            # In place, into the same buffers: the graph reads and writes fixed tensors at every step.
            kv.k.copy_(kv.k.index_select(0, perm))
            kv.v.copy_(kv.v.index_select(0, perm))
    return model.decode(memory, tokens, memory_mask, self_mask, cache=caches)[:, -1]


def _claim(model: Any, like: list[LayerCache], rows: int, bucket: int, src_bucket: int, owner: weakref.ref) -> _Static:
    """A free set of kept buffers of this shape for this model (made when none is free), claimed for ``owner``.

    ``like`` gives each layer's key/value heads and head size (the prefill caches, or a smaller bucket's set). The
    set stays ``owner``'s until that step function is freed (the end of a ``generate`` call, or of a stream:
    exhausted, closed or dropped) or the loop moves to a larger bucket (``_grown``).
    """
    first_self = like[0].self_attn.k
    device = first_self.device
    key = (rows, bucket, src_bucket, first_self.dtype, device)
    pool = _BUFFERS.setdefault(model, {}).setdefault(key, [])
    static = next((kept_set for kept_set in pool if kept_set.free()), None)
    if static is None:
        index = torch.zeros(1, dtype=torch.long, device=device)
        kept = []
        for layer_cache in like:
            kv, cross = layer_cache.self_attn, layer_cache.cross_attn
            holder = LayerCache(1, cross=True)
            self_kv = [t.new_zeros((rows, t.shape[1], bucket, t.shape[3])) for t in (kv.k, kv.v)]
            cross_kv = [t.new_zeros((rows, t.shape[1], src_bucket, t.shape[3])) for t in (cross.k, cross.v)]
            if device.type == "cuda":
                # CUDA graphs replay fixed addresses: the buffers must never move.
                for t in (*self_kv, *cross_kv):
                    torch._dynamo.mark_static_address(t)
            holder.self_attn = BucketKVCache(*self_kv, index)
            holder.cross_attn = StaticKVCache()
            holder.cross_attn.set(*cross_kv)
            kept.append(holder)
        d_model = model.config.d_model
        static = _Static(
            caches=kept,
            self_mask=torch.zeros((rows, bucket), dtype=torch.bool, device=device),
            index=index,
            memory=first_self.new_zeros(()).expand(rows, src_bucket, d_model),
            memory_mask=torch.zeros((rows, src_bucket), dtype=torch.bool, device=device),
            perm=torch.arange(rows, device=device),
        )
        pool.append(static)
    static.owner = owner
    return static


def _static_buffers(
    model: Any, prefill: list[LayerCache], src_mask: Tensor | None, width: int, bucket: int, owner: weakref.ref
) -> _Static:
    """A free set of kept buffers for this model and shape (``_claim``), filled from the eager first step.

    ``prefill`` holds the start token's self-attention keys/values (slot 0) and the cross-attention keys/values
    of ``B`` sources; each is repeated for the ``width`` rows of its source. ``owner`` is a weak reference to
    the step function that decodes with the set.
    """
    first_cross = prefill[0].cross_attn.k
    b, src_len = first_cross.shape[0], first_cross.shape[2]
    static = _claim(model, prefill, b * width, bucket, bucket_length(src_len, None), owner)
    for src, dst in zip(prefill, static.caches, strict=True):
        for s, d in ((src.self_attn.k, dst.self_attn.k), (src.self_attn.v, dst.self_attn.v)):
            d[:, :, :1] = s[:, :, :1].repeat_interleave(width, dim=0)
        for s, d in ((src.cross_attn.k, dst.cross_attn.k), (src.cross_attn.v, dst.cross_attn.v)):
            d[:, :, :src_len] = s.repeat_interleave(width, dim=0)
            d[:, :, src_len:] = 0  # hidden by the memory mask; zeros keep stale values out of 0 · x products
    static.memory_mask.zero_()
    static.memory_mask[:, :src_len] = True if src_mask is None else src_mask.repeat_interleave(width, dim=0)
    static.self_mask.zero_()
    static.self_mask[:, 0] = True  # the start token
    return static


def _grown(model: Any, static: _Static, bucket: int, filled: int) -> _Static:
    """The loop's buffers moved to the larger ``bucket``: the ``filled`` self-attention slots, the cross-attention
    keys/values and the masks are copied into a set of that shape, and ``static`` is freed for later calls."""
    rows, src_bucket = static.memory_mask.shape
    grown = _claim(model, static.caches, rows, bucket, src_bucket, static.owner)
    for src, dst in zip(static.caches, grown.caches, strict=True):
        for s, d in ((src.self_attn.k, dst.self_attn.k), (src.self_attn.v, dst.self_attn.v)):
            d[:, :, :filled] = s[:, :, :filled]
        for s, d in ((src.cross_attn.k, dst.cross_attn.k), (src.cross_attn.v, dst.cross_attn.v)):
            d.copy_(s)
    grown.memory_mask.copy_(static.memory_mask)
    grown.self_mask.zero_()
    grown.self_mask[:, :filled] = static.self_mask[:, :filled]
    static.owner = None
    return grown


def _prefill(model: Any, memory: Tensor, tokens: Tensor, src_mask: Tensor | None) -> tuple[Tensor, list[LayerCache]]:
    """The start token's step, eager: next-token logits ``(B, V)`` and the caches it filled."""
    prefill = stack.new_caches(len(model.decoder_layers), 1, cross=True)
    logits = model.decode(memory, tokens, src_mask, cache=prefill)[:, -1]
    return logits, prefill


def _buckets(model: Any, max_new_tokens: int) -> tuple[int, Callable[[int], int]]:
    """The first bucket of a loop and ``grow(bucket) -> the next one``. The start token and every generated token
    but the last are cached: at most ``max_new_tokens`` slots, reached only if the loop gets that far."""
    capacity = model.decoder_positional.max_positions
    return first_bucket(max_new_tokens, 1, capacity), lambda bucket: grown_bucket(bucket, max_new_tokens, capacity)


def greedy_step(
    model: Any, memory: Tensor, src_mask: Tensor | None, start: int, max_new_tokens: int, steady: bool = True
) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """The start token's logits and the compiled one-token ``step`` for greedy or sampled decoding.

    Args:
        model: a ``Seq2SeqTransformer`` in eval mode (the caller runs under ``torch.inference_mode``).
        memory: the encoder output ``(B, S, d_model)``.
        src_mask: ``(B, S)`` bool, True = real token, or None.
        start: the decoder start token.
        max_new_tokens: the most tokens to generate (>= 1).
        steady: nothing but the caller's loop touches the model between steps (``generate``), so the steps after
            the first skip dynamo's guard checks (``CompiledStep(..., skip_guards=True)``). False (``stream``,
            whose caller runs code between steps, e.g. an optimizer step or another decoding call): every step
            checks every guard.

    Returns:
        ``(logits (B, V), step)``: ``step(tokens (B,)) -> logits (B, V)`` for the token after ``tokens``.

    Shapes: memory ``(B, S, d_model)``, src_mask ``(B, S)`` -> logits ``(B, V)``.
    """
    b = memory.shape[0]
    first = torch.full((b, 1), start, dtype=torch.long, device=memory.device)
    logits, prefill = _prefill(model, memory, first, src_mask)
    run = compile_step(_step, model, memory.device)  # kept per (model, fn, device)
    bucket, grow = _buckets(model, max_new_tokens)
    filled, guarded = 1, True  # guarded: the next call checks dynamo's guards (first step, first in a bucket)

    def step(tokens: Tensor) -> Tensor:
        nonlocal filled, bucket, static, guarded
        if filled == bucket:  # full: move to the next bucket (its graph is compiled at its first step)
            bucket = grow(bucket)
            static, guarded = _grown(model, static, bucket, filled), True
        # The new token goes to slot `filled`: visible from now on, and the write index of this step.
        static.self_mask[:, filled] = True
        static.index.fill_(filled)
        filled += 1
        # Guards are checked at the first step of a bucket (which may compile) and at every step of a stream.
        skip, guarded = steady and not guarded, False
        out = run(model, tokens[:, None], static.self_mask, static.caches, static.memory, static.memory_mask, None,
                  skip_guards=skip)
        return out.clone()  # CUDA graphs reuse their output buffer at the next replay

    static = _static_buffers(model, prefill, src_mask, 1, bucket, weakref.ref(step))
    return logits, step


def beam_step(
    model: Any, memory: Tensor, src_mask: Tensor | None, max_new_tokens: int, num_beams: int
) -> StepFn:
    """The ``models.generation.beam_search`` step function over the compiled static-shape decoder.

    The first call (the start tokens, ``B`` rows) runs eagerly and fills the buffers; later calls map the
    search's rows (``A`` active sources × up to ``num_beams`` beams, grouped by source) onto the
    ``R = B · num_beams`` fixed rows, turn ``parents`` into the in-graph reorder ``perm`` and return the logits
    of the search's rows.

    Args:
        model: the ``Seq2SeqTransformer`` (as ``greedy_step``).
        memory: the encoder's output (as ``greedy_step``).
        src_mask: the source's padding mask (as ``greedy_step``).
        max_new_tokens: tokens to decode at most (as ``greedy_step``).
        num_beams: beams per source (>= 2).

    Returns:
        ``step(tokens (N, 1), parents (N,) | None, sources_changed) -> logits (N, V)`` (see
        ``models.generation.beam_search.StepFn``).

    Shapes: ``memory (B, S, d_model)``; the graph runs ``(B · num_beams, 1)`` tokens at every step.
    """
    k = num_beams
    vocab = model.config.vocab_size
    first, grow = _buckets(model, max_new_tokens)
    run = compile_step(_step, model, memory.device)  # kept per (model, fn, device)
    state: dict[str, Any] = {}

    def step(tokens: Tensor, parents: Tensor | None, sources_changed: bool) -> Tensor:
        del sources_changed  # a source's rows are fixed: cross-attention buffers never need reordering
        if parents is None:  # the start tokens, one row per source
            logits, prefill = _prefill(model, memory, tokens, src_mask)
            static = _static_buffers(model, prefill, src_mask, k, first, state["owner"])
            state.update(
                static=static, filled=1, width=1, bucket=first, guarded=True,
                identity=torch.arange(static.perm.shape[0], device=memory.device),
                phys=torch.arange(tokens.shape[0], device=memory.device) * k,  # search row -> fixed row
            )
            return logits
        static, filled, phys = state["static"], state["filled"], state["phys"]
        if filled == state["bucket"]:  # full: move to the next bucket (its graph is compiled at its first step)
            state["bucket"] = grow(state["bucket"])
            static = state["static"] = _grown(model, static, state["bucket"], filled)
            state["guarded"] = True
        n = tokens.shape[0]
        # beam_search keeps min(k, candidates) beams per source, with min(2k, beams · vocab) candidates: k
        # unless the vocabulary is smaller than k, when the first steps keep fewer.
        width = state["width"] = min(k, state["width"] * vocab)
        if n % width:
            raise RuntimeError(f"beam search gave {n} rows, not a multiple of {width} beams per source")
        parent_rows = phys.index_select(0, parents)  # (N,) fixed rows the new beams continue
        # Search row i is beam i % width of its source; the source is the parent's (beams never change sources).
        new_phys = parent_rows // k * k + torch.arange(n, device=tokens.device) % width
        static.perm.copy_(state["identity"]).index_copy_(0, new_phys, parent_rows)
        full = torch.zeros((static.perm.shape[0], 1), dtype=torch.long, device=tokens.device)
        full.index_copy_(0, new_phys, tokens)  # rows of finished sources decode token 0; their logits are unused
        static.self_mask[:, filled] = True
        static.index.fill_(filled)
        state["filled"], state["phys"] = filled + 1, new_phys
        skip, state["guarded"] = not state["guarded"], False  # every guard at the first step of a bucket
        out = run(model, full, static.self_mask, static.caches, static.memory, static.memory_mask, static.perm,
                  skip_guards=skip)
        return out.index_select(0, new_phys)  # a copy: safe from the next CUDA-graph replay

    state["owner"] = weakref.ref(step)  # weak: the step must not keep itself alive through its own state
    return step
