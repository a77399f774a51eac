"""Exporting and compiling the engine's decode-only steps ahead of time: the work of the compile process that
``serving.aot_steps`` starts (``main``).

A step of ``serving.runner`` reads its rows through the ``PagedBatch`` set on every layer's cache; ``StepModule``
takes that batch's tensors and the pools as flat inputs instead, so ``torch.export`` can trace it with the row,
entry and pool-block counts dynamic (``backed_size_oblivious``: a count of 1 is not specialised). The model is
rebuilt from its class and config with uninitialised weights (their values are never read: the engine hands its own
to the package) and the engine model's buffers (rotary frequencies, which the graph may fold).

Three steps are compiled: one decoding row (``"single"``, its products as 1-row reductions), 2 or more rows
(``"batch"``, its products through aten's ``mm``: BLAS) and ``WIDE_ROWS`` or more rows (``"wide"``, its products
through oneDNN's linear, ``OneDNNLinears``, where the CPU build has oneDNN). On one core, float32, oneDNN multiplies
4–16 rows by Qwen3-0.6B's weights 1.3–1.7× faster than BLAS and 2–3 rows 0.7–0.8× as fast
(``benchmarks.decode_products``); both read the weights in their own layout, so neither holds a second copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from blocks.paged_attention import RaggedRows
from blocks.paged_cache import PagedBatch, PagedLayerCache
from blocks.prepacked_linear import prepack_linears
from models.checkpoints.file_staging import staging_file
from models.checkpoints.folder_locks import fsync

from .single_row import one_row_mode

#: The steps compiled: one decoding row, several, and ``WIDE_ROWS`` or more (where oneDNN is built in), in that order.
KINDS = ("single", "batch", "wide") if torch.backends.mkldnn.is_available() else ("single", "batch")
#: The fewest rows of a ``"wide"`` step (oneDNN's products are slower than BLAS's below; measured on one core).
WIDE_ROWS = 4
#: Inputs of a step before its pools: ids, positions, keep, slots and the ``RaggedRows`` tensors.
N_BATCH_INPUTS = 10
#: AOTInductor's options: the weights are not put in the package (the engine hands over its own), and none is
#: inlined into a kernel as numbers (inductor inlines 1-d tensors of up to 8 elements, such as a small model's
#: qk-norm weights, by default: the values of the rebuilt model, not the engine's); no debug size asserts.
PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True,
                   "size_asserts": False}
#: The compile process's exit status for a model its config does not rebuild (the runner then compiles in-process).
NOT_EXPORTABLE = 3


def tensor_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """Every parameter and buffer of ``model`` (tied ones under each name) as ``(name, shape, dtype)``.

    Args:
        model: the model.

    Returns:
        The sorted list.
    """
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return sorted((name, tuple(t.shape), str(t.dtype)) for name, t in named)


def rebuilt(model_class: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """``model_class(config)`` in ``dtype`` and eval mode, its storage uninitialised (built on the meta device, then
    given empty CPU storage, tied parameters tied again): what export traces, its values never read.

    Args:
        model_class: the model's class.
        config: its config.
        dtype: the float dtype of the engine's model.

    Returns:
        The model.
    """
    with torch.device("meta"):
        model = model_class(config)
    tied: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    model = model.to_empty(device="cpu")  # (gives each name its own storage: ties are made again below)
    for first, *others in tied.values():
        for name in others:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, model.get_parameter(first))
    return model.to(dtype).eval()


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is True inside (non-strict ``torch.export`` does not set it): the model
    skips the checks that read tensor data, as it does under ``torch.compile``.

    Yields:
        None, with the flag set (restored after).
    """
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN (``torch.ops.mkldnn._linear_pointwise``), the weight read in its
    ``(out, in)`` layout, not packed.

    Args:
        x: the input.
        weight: the weight.
        bias: the bias, or None.

    Returns:
        The product.

    Shapes: x ``(..., in)``, weight ``(out, in)``, bias ``(out,)`` -> ``(..., out)``.
    """
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinears(TorchFunctionMode):
    """``nn.functional.linear`` of a float32 CPU input and a float32 contiguous 2-d weight traced as oneDNN's
    linear (``torch.ops.mkldnn._linear_pointwise``, its weight in its own layout, not packed); any other call as
    is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
                    and weight.dim() == 2 and weight.is_contiguous() and x.dim() >= 2):
                return onednn_linear(x, weight, bias)
        return func(*args, **kwargs)


class StepModule(nn.Module):
    """A decode-only step of ``serving.runner`` as a module of flat tensors (what ``torch.export`` takes): the
    packed batch's tensors, then every layer's key and value pools, in layer order.

    Args:
        model: the ``DecoderLM``.
        caches: its per-layer paged caches.
        block_size: positions per block.
        single: one decoding row (its products as 1-row reductions, ``serving.single_row``).
    """

    def __init__(self, model: nn.Module, caches: list[PagedLayerCache], block_size: int, single: bool) -> None:
        super().__init__()
        self.model, self.caches, self.block_size, self.single = model, caches, block_size, single

    def forward(self, ids: Tensor, positions: Tensor, keep: Tensor, slots: Tensor, query: Tensor, q_pos: Tensor,
                block: Tensor, row: Tensor, start: Tensor, layout: Tensor, *pools: Tensor) -> Tensor:
        """The rows' next-token logits; the new keys and values are written into ``pools`` in place.

        Args:
            ids: the rows' tokens.
            positions: their positions.
            keep: the packed index of each row.
            slots: the pool slot each new key and value is written to.
            query: ``RaggedRows.query``.
            q_pos: ``RaggedRows.q_pos``.
            block: ``RaggedRows.block``.
            row: ``RaggedRows.row``.
            start: ``RaggedRows.start``.
            layout: ``RaggedRows.layout``.
            *pools: every layer's key pool, then its value pool, in layer order.

        Returns:
            The logits.

        Shapes: ids ``(1, R)``, positions ``(1, R)``, keep ``(R,)``, slots ``(R,)``, the ``RaggedRows`` tensors
        (``whole``), pools ``(Hkv, blocks, block_size, D)`` -> ``(R, V)``.
        """
        rows = RaggedRows(query, q_pos, block, row, start, layout, whole=True)
        batch = PagedBatch.of_decoding_rows(positions[0], slots, keep, rows, self.block_size)
        for i, cache in enumerate(self.caches):
            cache.self_attn.k, cache.self_attn.v, cache.self_attn.batch = pools[2 * i], pools[2 * i + 1], batch
        with one_row_mode() if self.single else contextlib.nullcontext():
            return self.model(ids, positions=positions, cache=self.caches, logits_to_keep=keep).logits[0]


def step_inputs(ids: Tensor, positions: Tensor, keep: Tensor, caches: list[PagedLayerCache]) -> list[Tensor]:
    """The flat inputs of ``StepModule`` for a runner's step (its batch set on the caches, built with
    ``decode="ragged"``, every row decoding one token).

    Args:
        ids: ``(1, R)`` the rows' tokens.
        positions: ``(1, R)`` their positions.
        keep: ``(R,)`` the packed index of each row.
        caches: the per-layer caches, their batch set and pools grown.

    Returns:
        The inputs in ``StepModule.forward``'s order.

    Shapes: ids ``(1, R)``, positions ``(1, R)``, keep ``(R,)`` -> ``StepModule.forward``'s inputs.
    """
    batch = caches[0].self_attn.batch
    rows = batch.ragged
    pools = [pool for cache in caches for pool in (cache.self_attn.k, cache.self_attn.v)]
    return [ids, positions, keep, batch.slots, rows.query, rows.q_pos, rows.block, rows.row, rows.start,
            rows.layout, *pools]


def export_step(model: nn.Module, block_size: int, kind: str,
                kv_dtype: torch.dtype | None = None) -> torch.export.ExportedProgram:
    """Export one decode-only step of ``model`` with its row, entry and pool-block counts dynamic.

    Args:
        model: the ``DecoderLM`` (its tensors' values are not read).
        block_size: positions per block.
        kind: ``"single"`` (one row), ``"batch"`` (2 or more rows) or ``"wide"`` (``WIDE_ROWS`` or more, through
            oneDNN's linear).
        kv_dtype: the pools' dtype, or None for the model's.

    Returns:
        The exported program.
    """
    from torch.export import Dim

    # Sizes of 2 and more: nothing specialises on 1.
    contexts = {"single": [40], "batch": [40, 70, 20], "wide": [20 + 15 * i for i in range(WIDE_ROWS)]}[kind]
    caches = [PagedLayerCache(1 << 20, block_size, "paged", kv_dtype) for _ in model.layers]
    like = next(p for p in model.parameters() if p.is_floating_point())
    tables, first = [], 0
    for context in contexts:
        used = -(-context // block_size)
        tables.append((1, context, list(range(first, first + used))))
        first += used
    for layer, cache in zip(model.layers, caches, strict=True):
        cache.self_attn.grow(layer.self_attn, torch.empty(0, dtype=like.dtype), first)
    batch = PagedBatch(tables, block_size, "cpu", decode="ragged")
    for cache in caches:
        cache.self_attn.batch = batch
    n = len(contexts)
    args = step_inputs(torch.zeros(1, n, dtype=torch.long), batch.positions[None], batch.last, caches)
    rows = None if n == 1 else Dim("rows", min=WIDE_ROWS if kind == "wide" else 2)
    entries = Dim("entries", min=1)
    width, pool = Dim("width", min=1), Dim("pool_blocks", min=1)
    one = {0: rows} if rows else None
    shapes = ({1: rows} if rows else None, {1: rows} if rows else None, one, one, one, one,
              {0: entries}, {0: entries}, {0: entries}, {0: rows, 1: width} if rows else {1: width})
    module = StepModule(model, caches, block_size, single=kind == "single").eval()
    linears = OneDNNLinears() if kind == "wide" else contextlib.nullcontext()
    with torch.no_grad(), tracing(), fx_config.patch(backed_size_oblivious=True), linears:
        pools = tuple({1: pool} for _ in args[N_BATCH_INPUTS:])
        return torch.export.export(module, tuple(args), dynamic_shapes=(*shapes, pools), strict=False)


def compile_packages(spec: dict[str, Any]) -> None:
    """Build the packages of ``spec``: rebuild the model, check its tensors, export and compile
    each step, and move each package into place whole (written to a temporary name, then renamed).

    Args:
        spec: ``model_class``, ``config``, ``dtype``, ``signature``, ``buffers`` (the engine model's, by name),
            ``block_size``, ``kv_dtype`` (the pools', None for the model's), ``prepacked`` (the names of the engine
            model's ``blocks.prepacked_linear`` layers), ``folder``, ``threads`` (the engine's
            thread count, read by ``main``).

    Raises:
        TypeError: the rebuilt model's tensors are not the engine model's.
    """
    model = rebuilt(spec["model_class"], spec["config"], spec["dtype"])
    if spec.get("prepacked"):
        prepack_linears(model, names=spec["prepacked"])
    if tensor_signature(model) != spec["signature"]:
        raise TypeError("the model rebuilt from its config does not have the engine model's tensors")
    with torch.no_grad():  # the buffers' values (rotary frequencies) may be folded into the graph: the engine's
        for name, buffer in model.named_buffers(remove_duplicate=False):
            buffer.copy_(spec["buffers"][name])
    folder = Path(spec["folder"])
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "compile.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another engine's process compiling the same packages: wait for it
        for kind in KINDS:
            if not (folder / f"{kind}.pt2").exists():
                compile_package(model, spec["block_size"], kind, folder, spec.get("kv_dtype"))


def compile_package(model: nn.Module, block_size: int, kind: str, folder: Path,
                    kv_dtype: torch.dtype | None = None) -> None:
    """Export and compile one step into ``folder / f"{kind}.pt2"``, written whole: compiled into a staging file
    (``models.checkpoints.file_staging``: a killed compile's is removed by the next), flushed, renamed into place,
    the folder flushed.

    Args:
        model: the rebuilt model.
        block_size: positions per block.
        kind: one of ``KINDS``.
        folder: the packages' folder.
        kv_dtype: the pools' dtype, or None for the model's.
    """
    import torch._inductor  # (here: the engine's process imports this module, never the compiler)

    final = folder / f"{kind}.pt2"
    program = export_step(model, block_size, kind, kv_dtype)
    with staging_file(final) as staging:
        with open(staging, "r+b") as out:  # (a file object: a path must end in .pt2)
            torch._inductor.aoti_compile_and_package(program, package_path=out, inductor_configs=PACKAGE_OPTIONS)
        fsync(staging)
        os.replace(staging, final)
        fsync(folder)


def main(argv: list[str] | None = None) -> int:
    """The compile process: compile the packages a spec describes (a ``torch.save`` file the
    engine's process wrote; removed once read). Exits with ``NOT_EXPORTABLE`` for a model its config does not
    rebuild.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    (spec_path,) = sys.argv[1:] if argv is None else argv
    from torch._inductor import config

    torch.set_num_threads(1)
    config.compile_threads = 1  # one core: the engine's process runs beside it
    spec = torch.load(spec_path, weights_only=False)  # written by the engine's own process just before
    os.unlink(spec_path)
    config.cpp.threads = spec["threads"]  # the kernels' parallel loops: for the engine's threads, not this one's
    try:
        compile_packages(spec)
    except TypeError as err:
        print(f"not exportable: {err}", flush=True)
        return NOT_EXPORTABLE
    return 0

