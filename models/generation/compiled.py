"""A compiled, static-shape decode step for ``DecoderLM.generate(..., compile=True)``.

Decoding one token at a time is dispatch-bound in eager mode (hundreds of small operators per token). Here the
one-token step is compiled once (``torch.compile``: inductor on CPU; CUDA graphs, ``mode="reduce-overhead"``, on
CUDA) over a cache whose shapes never change:

- the cache (``blocks.kv_cache.BucketKVCache``) is allocated in *buckets* of length (powers of two from
  ``MIN_BUCKET``), so prompts of different lengths with the same bucket reuse one graph. A loop starts in the bucket
  holding the prompt and ``steps.CACHE_CHUNK`` new tokens and moves to a bucket twice as long when it is full (as
  the eager cache grows), so memory follows the tokens really generated, not ``max_new_tokens``; each bucket
  reached compiles the step once;
- the write slot is a long tensor and the visible slots are a ``(B, bucket)`` mask, both updated in place between
  steps: positions (counted from the mask, as for left padding) and the write index are tensors, never Python
  numbers a graph would specialise on;
- the buffers of a ``(model, batch, bucket)`` are kept and reused by later calls, so a later call reuses the
  graph (dynamo guards on the objects it reads);
- each model has its own compiled step (``compile_step``). On CPU a float model's weights are frozen into its
  graphs, so that inductor packs them for its C++ GEMM template (several rows: batches, beams); the graphs are
  compiled again when the weights change, and are freed with the model.

The prompt is prefilled eagerly (its length varies) into an ordinary cache whose contents are copied into the
bucket. Token choice (greedy, sampling, repetition penalty, EOS) runs outside the graph on the step's logits, so
every ``generate`` option works; tokens are identical to the eager path for greedy decoding up to float
rounding (inductor may reorder reductions; the test checks identity on its models).
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from blocks.kv_cache import BucketKVCache, LayerCache
from blocks.small_matmul import SmallRowsLinear

from ..core import stack
from . import steps  # steps.CACHE_CHUNK is read at call time (tests patch it)
from .constraints import RowConstraints
from .guard_trim import trim_module_guards
from .requests import LMRequest
from .sampling import seen_tokens
from .steps import Step, token_loop

#: The smallest cache bucket; buckets double from here.
MIN_BUCKET = 64

# Per model: {(batch, bucket, dtype, device): [_Kept, ...]} — reused so that the graph's guards hold; more than one
# set only while several loops of those shapes are open at once (streams).
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bucket_length(needed: int, capacity: int | None) -> int:
    """The smallest bucket (``MIN_BUCKET`` · 2^n) holding ``needed`` positions, capped at ``capacity``.

    Args:
        needed: the number of positions the bucket must hold.
        capacity: the model's maximum number of positions, or None for no cap.

    Returns:
        The bucket length: never below ``needed``, at most ``capacity`` unless ``needed`` is larger.
    """
    bucket = MIN_BUCKET
    while bucket < needed:
        bucket *= 2
    return bucket if capacity is None else max(needed, min(bucket, capacity))


def next_token_logits(model: Any, tokens: Tensor, mask: Tensor, caches: list[LayerCache]) -> Tensor:
    """The one-token decoder step that ``compiled_steps`` and the compiled speculative draft compile (one function,
    so they share its graphs).

    Args:
        model: the decoder language model.
        tokens: the one new token of each row.
        mask: the visible cache slots of each row.
        caches: the per-layer bucket caches, written in place at the write index.

    Returns:
        The logits of the next token of each row.

    Shapes: tokens ``(B, 1)``, mask ``(B, bucket)`` -> ``(B, V)``.
    """
    return model(tokens, attention_mask=mask, cache=caches).logits[:, -1]


#: The ``torch.compile`` backend (tests use ``"aot_eager"`` to count graphs without paying inductor's C++ build).
BACKEND = "inductor"

#: Inductor settings of a CPU step whose weights are all floating point: the weights become constants of the
#: graph (``freezing``), so inductor's C++ GEMM template packs each one once and multiplies the 2–8 rows of a
#: batched, beam or draft-verification step at several times BLAS's speed there (a 6 × 512 decoder step, batch 8,
#: on 2 CPU cores: 8–10 ms against 13 ms with the reductions of ``blocks.small_matmul``). Candidates are timed
#: once per shape (``max_autotune_gemm``, MKL kept as a candidate) without printing their timings; the graph's
#: debug size asserts are dropped.
FROZEN_OPTIONS: dict[str, Any] = {
    "freezing": True, "max_autotune_gemm": True, "max_autotune_gemm_backends": "CPP,ATEN", "size_asserts": False,
    "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False,
}

# Per model: {(fn, device kind, BACKEND): (weights state, CompiledStep)}. Dying with the model frees its graphs.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_state(model: nn.Module) -> tuple:
    """What tells a model's weights apart from their earlier values: each parameter's and buffer's storage and
    in-place version (an optimizer step, ``load_state_dict``, ``.to()``, merging an adapter all change it).

    Args:
        model: the model whose parameters and buffers are read.

    Returns:
        One ``(data_ptr, dtype, version)`` tuple per parameter and buffer (version -1 for an inference tensor).
    """
    state = []
    for t in (*model.parameters(), *model.buffers()):
        try:
            version = t._version
        except RuntimeError:  # an inference tensor keeps no version: only a new storage is seen
            version = -1
        state.append((t.data_ptr(), t.dtype, version))
    return tuple(state)


def freezes_weights(model: nn.Module, device: torch.device) -> bool:
    """Whether the step runs with ``FROZEN_OPTIONS``: inductor on CPU, float weights only (an int8 weight would be
    folded into a float constant, read at four bytes again).

    Args:
        model: the model to decode.
        device: the device the step runs on.

    Returns:
        True when the weights are to be frozen into the graph.
    """
    return (device.type == "cpu" and BACKEND == "inductor"
            and all(t.is_floating_point() for t in (*model.parameters(), *model.buffers())))


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under a copy of its code object. Dynamo keeps compiled graphs (and its recompile limit) per code
    object, so what ``torch.compile`` makes of the copy is never offered to another caller of ``fn``, and it is
    freed with the copy.

    Args:
        fn: the function to copy.

    Returns:
        A new function with the same globals, name, defaults and closure over a copy of ``fn.__code__``.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class CompiledStep:
    """A decoding step compiled for one model: call it as the function it wraps.

    ``skip_guards=True`` runs the graph the last guarded call chose without checking dynamo's guards (~1,400 of
    them, ~0.5 ms per token on 2 CPU cores) but the diff guards on the step's other inputs (``guard_trim``): only
    for later steps of one decoding loop, on the same model, buffers and shapes, with nothing else run in between.

    Args:
        fn: the step function to compile.
        frozen: whether the model's weights are frozen into the graph (``FROZEN_OPTIONS``).
        device: the device the step runs on (CUDA: CUDA graphs, ``mode="reduce-overhead"``).
    """

    def __init__(self, fn: Callable[..., Any], frozen: bool, device: torch.device) -> None:
        max_rows = 1 if frozen else None  # frozen: 2-8 rows go to the packed GEMM template, not the reductions

        def traced(*args: Any, **kwargs: Any) -> Any:
            with SmallRowsLinear(max_rows):
                return fn(*args, **kwargs)

        self.mode = lambda: SmallRowsLinear(max_rows)  # inside the layers' compile regions too

        # A code object of its own: this model's graphs (which hold its frozen weights) are never offered to another
        # model, or to this model after its weights change, and they are freed with this object.
        own = own_code(traced)
        mode = "reduce-overhead" if device.type == "cuda" and BACKEND == "inductor" else None
        self.compiled = torch.compile(own, dynamic=False, backend=BACKEND, mode=mode)
        self.code = own.__code__
        # Off CUDA, the graph's debug size asserts go too (~150 per step for a model whose weights are inputs).
        self.options = FROZEN_OPTIONS if frozen else {} if device.type == "cuda" else {"size_asserts": False}
        # Weights that are graph inputs let every layer of a structure share one compiled region.
        self.regional = not frozen

    def __call__(self, *args: Any, skip_guards: bool = False) -> Any:
        if skip_guards:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.compiled(*args)
        # Inductor reads its settings when it compiles, which only a guarded call can do.
        with torch._inductor.config.patch(self.options), stack.repeated_layer_regions(self.regional, self.mode):
            out = self.compiled(*args)
        # The model is the one this call checked until the next guarded call: later skipping steps need not.
        trim_module_guards(self.code, [i for i, arg in enumerate(args) if isinstance(arg, nn.Module)])
        return out


def compile_step(fn: Callable[..., Any], model: nn.Module, device: torch.device, rows: int | None = None
                 ) -> CompiledStep:
    """``fn`` compiled for decoding ``model`` on ``device``: static shapes, weights read fast.

    - 1-row ``F.linear`` calls (batch-1 decoding) take the fused reduction of ``blocks.small_matmul``.
    - On CPU, when every weight is floating point, the graph is compiled with ``FROZEN_OPTIONS``: the weights are
      constants of the graph and 2-8-row products use inductor's packed GEMM template. Those graphs hold a packed
      copy of each weight they multiply (as much memory again as those weights); they are recompiled when the
      weights change (``weights_state``: in place or replaced), and freed with the model.
    - Otherwise (int8 weights, CUDA) every product of up to ``blocks.small_matmul.MAX_ROWS`` rows takes the
      reductions, and on CUDA the graph runs under CUDA graphs (``mode="reduce-overhead"``), so outputs are
      overwritten by the next call: clone what is kept.

    - A step of one row (``rows=1``: batch-1 decoding, a single draft) is never frozen: its products all take the
      reductions, which read weights that are graph inputs as fast as constants. Unfrozen graphs compile each
      distinct decoder-layer structure once and reuse it for every layer (``models.core.stack.layer_call``), so
      the first call of a 30-layer model costs about what a one-layer model's does.

    One ``CompiledStep`` per ``(model, fn, device kind, BACKEND, frozen)``; dynamo keeps one graph per shape under
    it.

    Args:
        fn: the step function to compile (e.g. ``next_token_logits``).
        model: the model it decodes; its compiled steps are kept with it.
        device: the device the step runs on.
        rows: the number of rows of the step, when known (1 is never frozen).

    Returns:
        The model's ``CompiledStep`` for ``fn``, compiled anew when a frozen graph's weights changed.
    """
    frozen = freezes_weights(model, device) and rows != 1
    key = (fn, device.type, BACKEND, frozen)
    per_model = _COMPILED.setdefault(model, {})
    state = weights_state(model) if frozen else None
    if key not in per_model or per_model[key][0] != state:
        per_model[key] = (state, CompiledStep(fn, frozen, device))
    return per_model[key][1]


@dataclasses.dataclass
class _Kept:
    """One set of bucket buffers: the caches, the visible-slot mask and the write index."""

    caches: list[LayerCache]
    mask: Tensor  # (B, bucket) bool
    index: Tensor  # (1,) long
    owner: weakref.ref | None = None  # what decodes with the set (a step function, a draft); free once it is dead

    def free(self) -> bool:
        return self.owner is None or self.owner() is None


def bucket_buffers(model: Any, caches: list[LayerCache], b: int, bucket: int, owner: weakref.ref,
                   filled: int | None = None) -> tuple[list[LayerCache], Tensor, Tensor]:
    """A free set of kept bucket buffers for this model and shape (made when none is free), claimed for ``owner``
    and filled with the first ``filled`` positions of ``caches`` (default: what they hold, e.g. the prompt).

    A set stays ``owner``'s until it is freed (the end of a ``generate`` call, or of a stream: exhausted, closed or
    dropped; or ``release_buffers`` when a loop moves to a larger bucket): two streams open at once, or a stream
    left open around a ``generate`` call of the same shapes, each decode in their own buffers. A second set needs no
    new graph (dynamo guards on shapes, not on the tensors).

    Args:
        model: the model whose kept buffers are used.
        caches: the per-layer caches to copy from.
        b: the batch size.
        bucket: the bucket length.
        owner: a weak reference to what decodes with the set; the set is free again once it is dead.
        filled: how many positions of ``caches`` to copy (default: each cache's length).

    Returns:
        The set's per-layer caches, its visible-slot mask and its write index.

    Shapes: -> caches, mask ``(B, bucket)``, index ``(1,)``.
    """
    first = caches[0].self_attn.k
    key = (b, bucket, first.dtype, first.device)
    pool = _BUFFERS.setdefault(model, {}).setdefault(key, [])
    kept_set = next((candidate for candidate in pool if candidate.free()), None)
    if kept_set is None:
        index = torch.zeros(1, dtype=torch.long, device=first.device)
        kept = []
        for layer_cache in caches:
            kv = layer_cache.self_attn
            k = kv.k.new_zeros((*kv.k.shape[:2], bucket, kv.k.shape[3]))
            v = kv.v.new_zeros((*kv.v.shape[:2], bucket, kv.v.shape[3]))
            if first.device.type == "cuda":
                # CUDA graphs replay fixed addresses: the buffers must never move.
                torch._dynamo.mark_static_address(k)
                torch._dynamo.mark_static_address(v)
            holder = LayerCache(1)
            holder.self_attn = BucketKVCache(k, v, index)
            kept.append(holder)
        mask = torch.zeros((b, bucket), dtype=torch.bool, device=first.device)
        kept_set = _Kept(kept, mask, index)
        pool.append(kept_set)
    kept_set.owner = owner
    for src, dst in zip(caches, kept_set.caches, strict=True):
        n = src.self_attn.length if filled is None else filled
        dst.self_attn.k[:, :, :n] = src.self_attn.k[:, :, :n]
        dst.self_attn.v[:, :, :n] = src.self_attn.v[:, :, :n]
    return kept_set.caches, kept_set.mask, kept_set.index


def release_buffers(model: Any, caches: list[LayerCache]) -> None:
    """Free the kept set whose caches are ``caches`` (a loop that moved to a larger bucket), for later calls.

    Args:
        model: the model whose kept buffers are searched.
        caches: the caches of the set to free.
    """
    for pool in _BUFFERS.get(model, {}).values():
        for kept_set in pool:
            if kept_set.caches is caches:
                kept_set.owner = None


def first_bucket(needed: int, start: int, capacity: int | None) -> int:
    """The bucket a decoding loop starts in: room for ``start`` positions (the prompt) and up to
    ``steps.CACHE_CHUNK`` new ones, never more than ``needed`` (all a request can use), rounded up to a bucket.

    Like the eager cache, the bucket grows (``grown_bucket``) when it is full: a huge ``max_new_tokens`` costs
    memory only for the tokens really generated, and the step compiles once more per bucket reached.

    Args:
        needed: the positions the request can use (prompt plus ``max_new_tokens``).
        start: the prompt length.
        capacity: the model's maximum number of positions, or None.

    Returns:
        The first bucket length.
    """
    return bucket_length(min(needed, start + steps.CACHE_CHUNK), capacity)


def grown_bucket(bucket: int, needed: int, capacity: int | None) -> int:
    """The bucket after a full ``bucket``: twice as long, at most ``needed`` positions (rounded up to a bucket).

    Args:
        bucket: the full bucket's length.
        needed: the positions the request can use.
        capacity: the model's maximum number of positions, or None.

    Returns:
        The next bucket length.
    """
    return bucket_length(min(needed, 2 * bucket), capacity)


@torch.inference_mode()
def compiled_steps(model: Any, request: LMRequest, steady: bool = True, constraints: RowConstraints | None = None
                   ) -> Iterator[Step]:
    """Prefill eagerly, then decode with the compiled bucket step (the caller sets eval mode).

    ``steady``: nothing else touches the model between steps (``generate``; not ``stream``, whose caller runs
    between steps). Then the steps after the first skip dynamo's guard checks: they call the graph the first
    step chose, on the same model, buffers and shapes (checking ~1,400 guards costs ~0.5 ms per token on 2 CPU
    cores, a sixth of a step). ``constraints`` mask the logits outside the graph (no recompile).

    Args:
        model: the decoder language model.
        request: the checked request (prompt, mask, sampling parameters, EOS/pad, ``max_new_tokens``).
        steady: whether nothing else touches the model between steps (later steps then skip guard checks).
        constraints: per-row constraints on the tokens, or None.

    Yields:
        One ``Step`` per generated token (none when ``max_new_tokens`` is 0).
    """
    if request.max_new_tokens == 0:
        return
    prompt, prompt_mask = request.prompt, request.mask
    b, length = prompt.shape
    needed, capacity = length + request.max_new_tokens, model.positional.max_positions
    steps.refuse_longrope_switch(model, length, needed, "generate(compile=True)")
    bucket = first_bucket(needed, length, capacity)
    prefill = stack.new_caches(model.layers, length)
    logits = model(prompt, attention_mask=prompt_mask, cache=prefill, logits_to_keep=1).logits[:, -1]
    filled = length
    run = compile_step(next_token_logits, model, prompt.device, b)
    guarded = True  # the next call checks dynamo's guards (the first step, and the first in a new bucket)

    def step(tokens: Tensor) -> Tensor:
        nonlocal filled, bucket, caches, mask, index, guarded
        if filled == bucket:  # full: move to the next bucket (its graph is compiled at its first step)
            old_caches, old_mask = caches, mask
            bucket = grown_bucket(bucket, needed, capacity)
            caches, mask, index = bucket_buffers(model, old_caches, b, bucket, owner, filled)
            mask.zero_()
            mask[:, :filled] = old_mask
            release_buffers(model, old_caches)
            guarded = True
        # The new token goes to slot `filled`: visible from now on, and the write index of this step.
        mask[:, filled] = True
        index.fill_(filled)
        filled += 1
        # Clone: CUDA graphs reuse their output buffer at the next replay.
        # Every guard is checked at the first step of a bucket (which may compile), and at every step of a stream.
        skip, guarded = steady and not guarded, False
        return run(model, tokens[:, None], mask, caches, skip_guards=skip).clone()

    # The buffers are this loop's while `step` lives (it dies with this generator; weak: no cycle through itself).
    owner = weakref.ref(step)
    caches, mask, index = bucket_buffers(model, prefill, b, bucket, owner)
    mask.zero_()
    mask[:, :length] = True if prompt_mask is None else prompt_mask

    seen = seen_tokens(prompt, prompt_mask, model.config.vocab_size) if request.params.uses_history else None
    yield from token_loop(
        logits, step, request.params, request.generator, request.eos, request.pad, request.max_new_tokens, seen,
        constraints,
    )
