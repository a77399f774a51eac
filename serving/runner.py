"""The model step over a paged cache: one packed forward pass of prefill chunks and decode rows together.

With ``compile=True`` the steps whose rows all decode one token run a compiled graph of the whole step: a step of
one row (a lone request) the single-row graph (``serving.single_row.SingleRowStep``, as ``generate(compile=True)``
compiles its batch-1 step), a step of several rows ``DynamicStep``, its token, row and block counts dynamic: one
graph serves every such step, with no padding. Its one-token rows attend without padding
(``blocks.paged_attention``: one entry per row and block read). A graph never grows the pools: the runner grows them
before it runs (``grow_pools``), and their block count is a dynamic input. Steps holding a prefill chunk stay eager.

With ``compile="aot"`` the same two decode-only steps are compiled ahead of time in another process
(``serving.aot_steps``: no compiler in the engine's process), and a third for ``WIDE_ROWS`` or more rows whose
products run through oneDNN (``serving.aot_export``); they run eagerly until their packages are ready; the other
steps stay eager (a model its config does not describe is compiled as with ``compile=True``).

With ``compile="attention"`` (and in the eager steps of ``compile=True``) only the attention of the one-token rows
is compiled (``RaggedAttention``): one graph with dynamic counts, so every step, a prefill chunk's included, reads
each decoding row's keys and values once, in place, instead of gathering padded copies of them for the backend.
Latent attention (``paged_latent``) attends its own way: its compiled steps take the one-token rows as one group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor

from blocks import get
from blocks.paged_attention import RaggedRows, ragged_decode_attention
from blocks.paged_cache import PagedBatch, PagedLayerCache
from models.core import stack
from models.generation import compiled
from models.generation.steps import eval_mode

from .aot_export import WIDE_ROWS
from .aot_steps import AheadOfTimeSteps, PackagedStep, checked, exportable
from .memory import compiled_graph_count, release_compile_state
from .single_row import SingleRowStep, mark_pools

log = logging.getLogger(__name__)

#: The values of ``compile`` (``PagedRunner``, ``serving.Engine``).
COMPILE_MODES = (False, True, "attention", "single", "aot")


def check_compile(compile: Any) -> None:  # noqa: A002
    """Raise ``ValueError`` unless ``compile`` is one of ``COMPILE_MODES``.

    Args:
        compile: the ``compile`` argument to check.

    Raises:
        ValueError: ``compile`` is neither a bool nor ``"attention"``, ``"single"`` or ``"aot"``.
    """
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile in COMPILE_MODES)):
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")


def check_prepack(prepack_weights: Any, max_loras: Any, loras: Any) -> None:
    """Raise unless ``Engine``'s ``prepack_weights`` is a bool, and False where adapters are asked for.

    Args:
        prepack_weights: the argument to check.
        max_loras: the engine's adapter slots.
        loras: the adapters to load.

    Raises:
        ValueError: not a bool, or True with ``max_loras`` or ``loras`` (adapters read the plain weights).
    """
    if not isinstance(prepack_weights, bool):
        raise ValueError(f"prepack_weights must be True or False, got {prepack_weights!r}")
    if prepack_weights and (max_loras or loras):
        raise ValueError("prepack_weights cannot be combined with adapters (max_loras, loras): LoRA slots wrap the "
                         "plain linear layers; drop one of them")


def packed_logits(model: Any, ids: Tensor, positions: Tensor, caches: list[PagedLayerCache], keep: Tensor) -> Tensor:
    """One packed forward pass: the logits at ``keep`` (the function the compiled step wraps).

    Args:
        model: the ``DecoderLM``.
        ids: the new tokens of every row, packed into one sequence.
        positions: each token's position in its row.
        caches: the per-layer paged caches, their ``batch`` set.
        keep: the packed indices whose logits are returned (each row's last new token).

    Returns:
        The logits at ``keep``.

    Shapes: ids ``(1, T)``, positions ``(1, T)``, keep ``(R,)`` -> ``(R, V)``.
    """
    return model(ids, positions=positions, cache=caches, logits_to_keep=keep).logits[0]


def paged_kind(layer: Any) -> str:
    """The registered ``kv_cache`` kind of a decoder layer's paged cache: its attention's ``paged_cache_kind``
    (``"paged_latent"`` for latent attention), ``"paged"`` by default.

    Args:
        layer: a decoder layer (with ``self_attn``).

    Returns:
        The ``kv_cache`` registry name.
    """
    return getattr(layer.self_attn, "paged_cache_kind", "paged")


def float_like(model: Any) -> Tensor:
    """An empty tensor in the dtype and on the device of ``model``'s floating parameters: what its activations and
    key/value pools take. The most common floating dtype decides; the packed tensors of quantized layers and
    embeddings (int8 buffers, and no ``weight`` parameter) have no say, so a quantized model's float dtype is found
    as well as a float model's.

    Args:
        model: the model.

    Returns:
        An empty tensor of that dtype and device.

    Raises:
        ValueError: ``model`` has no floating parameter (nothing tells its float dtype).

    Shapes: ``(0,)``.
    """
    floats = [p for p in model.parameters() if p.is_floating_point()]
    if not floats:
        raise ValueError(f"this {type(model).__name__} has no floating parameter to take its float dtype and device "
                         "from; expected a model with float norms, biases or weights")
    dtypes = [p.dtype for p in floats]
    return torch.empty(0, dtype=max(set(dtypes), key=dtypes.count), device=floats[0].device)


def block_nbytes(model: Any, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes one paged block of ``block_size`` positions takes over every layer of ``model``, in ``kv_dtype`` (or
    its float dtype).

    Args:
        model: the ``DecoderLM``.
        block_size: positions per block.
        kv_dtype: the pools' dtype, or None for the model's float dtype.

    Returns:
        The block's size in bytes.
    """
    element = (kv_dtype or float_like(model).dtype).itemsize
    return block_size * element * sum(get("kv_cache", paged_kind(layer)).numbers_per_position(layer.self_attn)
                                      for layer in model.layers)


def mark_dynamic(*tensors: tuple[Tensor, tuple[int, ...]]) -> None:
    """Mark the listed dims of each tensor dynamic for ``torch.compile`` (one graph for every size).

    Args:
        *tensors: ``(tensor, dims)`` pairs.
    """
    for tensor, dims in tensors:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def mark_batch(batch: PagedBatch) -> None:
    """Mark a packed batch's token, row, entry and block counts dynamic.

    Args:
        batch: the step's packed batch.
    """
    mark_dynamic((batch.positions, (0,)), (batch.slots, (0,)), (batch.last, (0,)))
    if batch.ragged is not None:
        mark_ragged(batch.ragged)
    for group in batch.groups:
        mark_dynamic((group.q_index, (0,)), (group.valid, (0,)), (group.flat, (0,)), (group.tables, (0, 1)),
                     (group.q_pos, (0,)))


def mark_ragged(rows: RaggedRows) -> None:
    """Mark the row, entry and width counts of ragged decode rows dynamic.

    Args:
        rows: the ragged decode rows.
    """
    mark_dynamic((rows.query, (0,)), (rows.q_pos, (0,)), (rows.block, (0,)), (rows.row, (0,)), (rows.start, (0,)),
                 (rows.layout, (0, 1)))


def compile_dynamic(fn: Callable[..., Any], regions: bool = False) -> Callable[..., Any]:
    """``fn`` compiled under a code object of its own (the graphs of one runner are not offered to another's), run
    size-oblivious (``backed_size_oblivious``): a count of 1 is not specialised, so one graph serves every size of
    the dims marked dynamic; with ``regions``, each decoder layer structure is traced and compiled once
    (``models.core.stack.repeated_layer_regions``).

    Args:
        fn: the function to compile.
        regions: compile each decoder layer structure once.

    Returns:
        A function with ``fn``'s arguments that runs the compiled graph.
    """
    compiled_fn = torch.compile(compiled.own_code(fn), backend=compiled.BACKEND)

    def run(*args: Any) -> Any:
        # With regions, every decoder layer of one structure is one nested compile region: a 30-layer model's step
        # compiles about as fast as a one-layer model's (its weights are graph inputs).
        with fx_config.patch(backed_size_oblivious=True), stack.repeated_layer_regions(regions):
            return compiled_fn(*args)

    return run


class RaggedAttention:
    """``ragged_decode_attention`` compiled for one runner with its row, entry and pool-block counts dynamic.
    Called as ``ragged_decode_attention``."""

    def __init__(self) -> None:
        self.compiled = compile_dynamic(ragged_decode_attention)

    def __call__(self, k_pool: Tensor, v_pool: Tensor, q: Tensor, rows: RaggedRows, *args: Any) -> Tensor:
        mark_dynamic((k_pool, (1,)), (v_pool, (1,)), (q, (0,)))
        mark_ragged(rows)
        return self.compiled(k_pool, v_pool, q, rows, *args)


class DynamicStep:
    """``packed_logits`` of a decode-only step compiled once, its token, row, entry and block counts dynamic: one
    graph for every step. Called as ``packed_logits``.

    Args:
        regions: compile each decoder layer structure once (``compile_dynamic``; not for latent attention, whose
            batch holds aliasing index tensors).
    """

    def __init__(self, regions: bool = False) -> None:
        self.compiled = compile_dynamic(packed_logits, regions)

    def __call__(self, model: Any, ids: Tensor, positions: Tensor, caches: list[PagedLayerCache],
                 keep: Tensor) -> Tensor:
        mark_dynamic((ids, (1,)), (positions, (1,)), (keep, (0,)))
        mark_batch(caches[0].self_attn.batch)
        return self.compiled(model, ids, positions, caches, keep)


class PagedRunner:
    """Runs a ``DecoderLM`` on packed rows over its own per-layer paged pools.

    Rows are packed into one sequence ``(1, T)`` (flattened tokens, no padding in the projections and FFN);
    positions come from each row's cached length, attention gathers each row's blocks (``blocks.paged_cache``).

    Args:
        model: the ``DecoderLM``.
        n_blocks: blocks each layer's pool may grow to.
        block_size: positions per block.
        compile: ``True``: run decode-only steps through one compiled graph with dynamic shapes
            (``DynamicStep``), and the attention of one-token rows in the other steps through ``RaggedAttention``;
            ``"attention"``: only the latter (every step stays eager around one compiled attention graph);
            ``"single"``: the single-row graph for a step of one decoding row, the other steps as ``"attention"``
            runs them; ``"aot"``: the two graphs of ``True`` compiled ahead of time in another process, and one
            for ``WIDE_ROWS`` or more rows through oneDNN (``serving.aot_steps``; started by ``start_aot``), the
            other steps eager; ``False``: nothing compiled.
        kv_dtype: the pools' float dtype (``PagedKVCache``'s ``dtype``: float16 keys and values under a float32
            model), or None for the model's.

    Raises:
        NotImplementedError: a positional encoding with an attention bias (ALiBi, T5's relative bias), or a
            ``kv_dtype`` other than the model's for latent attention's cache.
    """

    def __init__(self, model: Any, n_blocks: int, block_size: int, compile: bool | str = False,  # noqa: A002
                 kv_dtype: torch.dtype | None = None) -> None:
        check_compile(compile)
        probe = torch.zeros(1, 1, dtype=torch.long)
        for positional in (model.positional, *model.layer_positionals.values()):
            if positional.attention_bias(probe, probe) is not None:
                raise NotImplementedError(
                    f"the paged engine does not support attention biases ({type(positional).__name__})"
                )
        self.model, self.block_size, self.n_blocks = model, block_size, n_blocks
        like = float_like(model)  # not embed_tokens.weight: a quantized embedding's packed table is int8
        self.device = like.device
        self.kv_dtype = None if kv_dtype == like.dtype else kv_dtype  # None: the model's
        self.caches = [PagedLayerCache(n_blocks, block_size, paged_kind(layer), self.kv_dtype)
                       for layer in model.layers]
        workspace: dict[str, Tensor] = {}  # each layer's gathers are consumed before the next layer's
        for cache in self.caches:
            cache.self_attn.workspace = workspace
        plain = all(paged_kind(layer) == "paged" for layer in model.layers)  # no latent cache
        self.decode = "split"  # how eager steps attend one-token rows (``compile_steps`` may change it)
        self.compiled_decode = "ragged" if plain else "one"  # ... and compiled decode-only steps
        self.step: DynamicStep | PackagedStep | None = None
        self.single: SingleRowStep | PackagedStep | None = None  # a step of one decoding row (a lone request)
        self.wide: PackagedStep | None = None  # with compile="aot": a step of WIDE_ROWS or more decoding rows
        self.like, self.attentions = like, [layer.self_attn for layer in model.layers]
        self.modules = list(model.modules())
        self.mode, self.aot = compile, None
        self.graphs_seen: int | None = None
        if compile != "aot":
            self.compile_steps(compile)

    def compile_steps(self, compile: bool | str) -> None:  # noqa: A002
        """Set up the in-process compiled steps of a ``compile`` mode (``torch.compile``; none for ``False``).

        Args:
            compile: ``True``, ``"attention"``, ``"single"`` or ``False``.
        """
        plain = all(paged_kind(layer) == "paged" for layer in self.model.layers)  # no latent cache
        # How one-token rows are attended in eager steps (PagedBatch's decode), and in compiled decode-only steps.
        self.decode = "ragged" if compile and plain else "split"
        if compile and plain:
            attention = RaggedAttention()
            for cache in self.caches:
                cache.self_attn.ragged_attention = attention
        # The pools grow between steps (``grow_pools``): a graph takes them as inputs.
        if compile is True:
            self.step = DynamicStep(regions=plain)
        if compile in (True, "single"):
            self.single = SingleRowStep(regions=plain)
        # After a step that compiled a graph, what the compile kept and running never reads is freed.
        self.graphs_seen = compiled_graph_count() if compile else None

    def start_aot(self) -> None:
        """With ``compile="aot"``, start compiling the packages (or load them from disk): called once the model's
        structure is final (after the engine adds its LoRA slots), else at the first step. A model that cannot be
        exported (``serving.aot_steps.exportable``) is compiled in-process as with ``compile=True``."""
        if self.mode != "aot" or self.aot is not None or self.step is not None or self.single is not None:
            return
        reason = exportable(self.model)
        if reason is not None:
            log.info("compile='aot': %s; compiling in this process instead (compile=True)", reason)
            self.compile_steps(True)
            return
        self.aot = AheadOfTimeSteps(self.model, self.block_size, self.like.dtype, self.kv_dtype)

    def refresh_aot(self) -> None:
        """With ``compile="aot"``, take the packages loaded so far as the decode-only steps (none while compiling,
        or after a failure); a model the compile process found its config does not rebuild is compiled in-process
        from now on (``compile=True``)."""
        self.start_aot()
        if self.aot is None:
            return
        loaded = self.aot.poll()
        self.single, self.step, self.wide = loaded.get("single"), loaded.get("batch"), loaded.get("wide")
        if self.aot.unexportable:
            self.aot = None
            self.compile_steps(True)

    @torch.inference_mode()
    def scrub(self, blocks: Sequence[int]) -> None:
        """Zero ``blocks`` in every layer's pools (what a failed request wrote must not be read again: a masked
        slot of a reused block still enters the attention products).

        Args:
            blocks: the block ids to zero.
        """
        index = torch.as_tensor(list(blocks), dtype=torch.long)
        for cache in self.caches:
            cache.self_attn.scrub(index)

    def grow_pools(self, needed: int) -> None:
        """Grow every layer's pools to hold ``needed`` blocks (doubling; before a compiled step, which never grows
        them) and mark their block counts dynamic (a grown pool reuses the graph).

        Args:
            needed: blocks the pools must hold (the step's highest block id + 1).
        """
        for attention, cache in zip(self.attentions, self.caches, strict=True):
            cache.self_attn.grow(attention, self.like, needed)
        if self.aot is None:  # (a package takes any block count; marking would import the compiler)
            mark_pools(self.caches)

    @property
    def nbytes(self) -> int:
        """Bytes the key/value pools hold now."""
        return sum(cache.self_attn.nbytes for cache in self.caches)

    def block_nbytes(self) -> int:
        """Bytes one block takes over all layers (0 before the first step).

        Returns:
            The block's size in bytes.
        """
        return sum(cache.self_attn.block_nbytes() for cache in self.caches)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], rows: Sequence[tuple[int, int, Sequence[int]]]) -> Tensor:
        """Logits at the last new token of each row.

        Args:
            ids: the new tokens of every row, concatenated.
            rows: per row ``(n_new, n_cached_after, block_table)`` (see ``PagedBatch``).

        Returns:
            ``(n_rows, vocab_size)`` float logits.

        Shapes: -> ``(R, V)``, one row per entry of ``rows``.
        """
        device = self.device
        if self.mode == "aot":
            self.refresh_aot()
        step, decode = packed_logits, self.decode
        graph = self.single if len(rows) == 1 else self.wide if len(rows) >= WIDE_ROWS and self.wide else self.step
        if graph is not None and all(n_query == 1 for n_query, _, _ in rows):
            step, decode = graph, self.compiled_decode
        batch = PagedBatch(rows, self.block_size, device, decode=decode)
        if step is not packed_logits:
            self.grow_pools(batch.max_block)
        for cache in self.caches:
            cache.self_attn.batch = batch
        # eval_mode sets and restores every submodule's flag (a tenth of a small step): only when one is training.
        training = any(m.training for m in self.modules)  # a list kept: walking a 30-layer tree costs a millisecond
        with eval_mode(self.model) if training else contextlib.nullcontext():
            tokens = torch.tensor([list(ids)], device=device)
            logits = step(self.model, tokens, batch.positions[None], self.caches, batch.last)
            if isinstance(step, PackagedStep) and not step.checked:  # a package's first step: against eager's
                reference = packed_logits(self.model, tokens, batch.positions[None], self.caches, batch.last)
                if not checked(step, self.aot, logits, reference):
                    self.single = self.step = self.wide = None
                    logits = reference
        for cache in self.caches:
            cache.self_attn.batch = None
        if self.graphs_seen is not None and compiled_graph_count() != self.graphs_seen:
            release_compile_state()
            self.graphs_seen = compiled_graph_count()
        return logits
