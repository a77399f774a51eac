"""Loading a checkpoint: resolve it, read it, build the model and strictly load the weights into it.

``load_pretrained`` serves ``models.from_pretrained`` and every ``Model.from_pretrained``. A zoo checkpoint names
its class in ``config.json`` (``models.checkpoints.architectures``); checkpoints written by ``transformers`` (a
``config.json`` with ``model_type``) and single-file formats (GGUF: ``models.gguf``, which registers itself with
``register_file_format``) are converted on the fly by ``models.convert.from_transformers``. A quantized checkpoint
(a ``quantization`` entry in ``config.json``, see ``models.checkpoints.persistence``) is loaded into a freshly built
model whose recorded layers were quantized first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Unpack

import torch
from torch import Tensor, nn

from blocks.quantized import quantization_mismatch, quantized_modules, quantized_skeleton, state_names_of

from ..convert import registry as converters
from .architectures import get_architecture
from .atomic import reading
from .file_formats import FileFormat, read_single_file, register_file_format, single_file
from .files import (
    FORMAT_VERSION,
    MAX_CONFIG_BYTES,
    QUANTIZATION_KEY,
    SOURCE_FAMILY_KEY,
    is_transformers_config,
    is_zoo_config,
    load_tokenizer,
    quantization_entry,
    read_json,
    read_weights,
)
from .hub import hub_download
from .locate import checkpoint_files, locate
from .new_head import with_head
from .options import LoadOptions, ParsedOptions, parse_options
from .packed import packed_into_skeleton, with_changed_decoded
from .sentence_folder import fit_sentence_options, located_json, read_sentence_folder, unused_by_sentence_models

__all__ = ["FileFormat", "load_pretrained", "load_state_into", "register_file_format"]

logger = logging.getLogger(__name__)


#: byte alignment of the blocks PyTorch's CPU allocator returns (c10's gAlignment); quantized tensors get it.
_ALIGNMENT = 64


def load_pretrained(
    path_or_repo_id: str | os.PathLike[str],
    expected_class: type[nn.Module] | None,
    **options: Unpack[LoadOptions],
) -> nn.Module:
    """Resolve, read, build and strictly load a checkpoint from a local folder, a GGUF file or a Hub repo.

    A local file ending in ``.gguf`` is read by ``models.gguf.read_gguf`` (needs the ``gguf`` package; a format
    registered with ``register_file_format``) and
    converted like a ``transformers`` checkpoint; its embedded tokenizer becomes ``model.tokenizer``.

    Args:
        path_or_repo_id: a checkpoint folder, a ``.gguf`` file, or a Hub repo id (``"namespace/name"``).
        expected_class: the class the caller asked for (``None``: whatever the checkpoint holds).
        **options: see ``LoadOptions``.

    Returns:
        The model in eval mode; ``model.tokenizer`` is set when the checkpoint holds a tokenizer.

    Raises:
        TypeError: an unknown keyword argument, or arguments of the wrong type.
        ValueError: bad option values; a config of another architecture than ``expected_class``; weights that
            do not fit the config (missing, unexpected or mis-shaped tensors, all listed); a config that counts
            other layers than the weights store, or would build a model larger than the weights (the field is
            named; checked before the model is built, see ``models.convert.registry.build_bounded``); unreadable
            or corrupted files; a pickle that is not plain tensors.
        FileNotFoundError: a local folder without ``config.json`` or weights; a ``.gguf`` path that is no file.
        ImportError: a ``.gguf`` file without the ``gguf`` package.
        huggingface_hub.errors.RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError: the repo,
            revision or a required file does not exist on the Hub (the message names repo and revision).
        huggingface_hub.errors.HfHubHTTPError: the Hub kept failing (its status is in the message) after retries.
    """
    opts = parse_options(options)
    if opts.gguf_file is not None:  # a .gguf file inside a folder or Hub repo, fetched first
        path_or_repo_id = _fetch_gguf(path_or_repo_id, opts)
    single = single_file(path_or_repo_id)
    allow_missing: frozenset[str] = frozenset()
    quantization: tuple[dict[str, str], dict[str, dict[str, Any]]] | None = None
    sentence = None  # a sentence-transformers folder's embedding head options
    family = None  # the transformers model_type the model came from (kept for exports)
    if single is not None:
        gguf_file, file_format = single
        if opts.revision is not None and opts.gguf_file is None:
            raise ValueError(f"revision={opts.revision!r} only applies to Hub repos, but {gguf_file} is a local file")
        source = str(gguf_file)
        hf_config, hf_state, tokenizer = read_single_file(gguf_file, file_format, opts.dtype, not opts.dequantize)
        cls, config, state, allow_missing = _convert_transformers(hf_config, hf_state, expected_class, source)
        family = hf_config.get("model_type")
        redo = with_changed_decoded(hf_state, state, source)
        if redo is not None:  # a converter changed a packed weight: that one loads as float
            cls, config, state, allow_missing = _convert_transformers(hf_config, redo, expected_class, source)
        del hf_state  # only the converted state is loaded: the reader's dict goes now
    else:
        location = locate(
            path_or_repo_id, revision=opts.revision, token=opts.token, endpoint=opts.endpoint
        )
        with reading(location.folder):  # a local folder is read as one complete checkpoint, never mid-save
            raw = read_json(location.config, MAX_CONFIG_BYTES)
            if is_zoo_config(raw):
                # Config first: a checkpoint of the wrong class is refused before its weights are downloaded.
                cls, config = _zoo_class_and_config(raw, expected_class, location.source)
                quantization = quantization_entry(raw, location.source)
                family = raw.get(SOURCE_FAMILY_KEY)
                if family is not None and not isinstance(family, str):
                    raise ValueError(f"{location.source}: config.json has {SOURCE_FAMILY_KEY}={family!r}; "
                                     "expected a transformers model_type string or null")
                files = checkpoint_files(location)
                state = read_weights(files)
                # Before the real build: the config may not claim more layers or elements than the weights hold.
                converters.build_bounded(cls, config, state, files.source)
            elif is_transformers_config(raw):
                files = checkpoint_files(location)
                state = read_weights(files)
            else:
                raise ValueError(
                    f"{location.config} is neither a transformer-zoo config (keys 'architecture' and "
                    f"'format_version') nor a transformers config (key 'model_type'); it has keys {sorted(raw)}"
                )
            tokenizer = load_tokenizer(files.tokenizer) if files.tokenizer is not None else None
            if is_transformers_config(raw):
                sentence = read_sentence_folder(lambda name: located_json(location, name), location.source)
        source = files.source
        if is_transformers_config(raw):
            with unused_by_sentence_models(sentence is not None and opts.head is None):
                cls, config, state, allow_missing = _convert_transformers(raw, state, expected_class, source)
                family = raw["model_type"]
                if sentence is not None and opts.head is None:
                    sentence = fit_sentence_options(sentence, config.max_len)
                    config, state, allow_missing = with_head(cls, config, state, allow_missing, "embedding",
                                                             sentence, source)

    # transformers' BERT config.json does not store the [MASK] id; the checkpoint's tokenizer knows it.
    if tokenizer is not None and getattr(config, "mask_token_id", 0) is None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            config = config.replace(mask_token_id=tokenizer.mask_token_id)

    if opts.head is not None or opts.head_options:
        config, state, allow_missing = with_head(cls, config, state, allow_missing, opts.head, opts.head_options,
                                                 source)
    # All weights given (and assigned, not copied): an uninitialised model's memory is never resident, peak ~1 model.
    with _skipped_init() if single is not None and not allow_missing else contextlib.nullcontext():
        model = cls(config)
    state = packed_into_skeleton(model, state)
    if quantization is not None:
        # Give the fresh model the saved model's quantized layers, then load the packed tensors into them.
        layers, scheme_options = quantization
        try:
            quantized_skeleton(model, layers, scheme_options)
        except ValueError as e:
            raise ValueError(
                f"{source}: config.json's {QUANTIZATION_KEY!r} entry does not fit {cls.__name__}: {e}"
            ) from e
    load_state_into(model, state, allow_missing=allow_missing, dtype=opts.dtype, source=source)
    if opts.attention_backend is not None:
        model.set_attention_backend(opts.attention_backend)
    if opts.device is not None:
        model.to(opts.device)
    model.eval()
    if tokenizer is not None:
        model.tokenizer = tokenizer
    if family is not None:
        model.transformers_model_type = family
    return model


def load_state_into(
    model: nn.Module,
    state: Mapping[str, Tensor],
    *,
    allow_missing: frozenset[str] = frozenset(),
    dtype: torch.dtype | None = None,
    source: str = "checkpoint",
) -> None:
    """Strictly copy ``state`` into ``model``, keeping tied weights tied.

    Tied tensors (one object under several names) need only one of their names in ``state``. The model takes
    one floating dtype: ``dtype`` if given, else the dtype that holds most of the checkpoint's floating
    elements. Floating tensors stored in another dtype are cast to it (a warning names them when ``dtype`` was
    not asked for): a model whose parameters mix dtypes fails at its first matmul, so mixing is never kept.

    Args:
        model: a freshly built model.
        state: name -> tensor, in the model's naming.
        allow_missing: names that may be absent: they keep their initialisation and a warning is logged.
        dtype: target floating dtype, or ``None``.
        source: how to name the checkpoint in messages.

    Raises:
        ValueError: missing, unexpected or mis-shaped tensors (every one listed), integer tensors of another
            dtype than the model's (int8 weights stored wider), tied names whose tensors in ``state`` differ, or
            quantized weights for a model whose layers are unquantized, or the reverse (the scheme is named).

    Shapes: each tensor of ``state`` as the model's tensor of that name.
    """
    mismatch = quantization_mismatch(model, state)
    if mismatch is not None:
        raise ValueError(f"the weights in {source} do not fit {type(model).__name__}: {mismatch}")
    # Packed tensors keep their own dtypes (a float16 block scale is part of its format): never cast, never counted
    # in the model's floating dtype.
    packed = {f"{name}.{n}" for name in quantized_modules(model)
              for n in state_names_of(model.get_submodule(name))}
    targets = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        groups.setdefault(id(tensor), []).append(name)

    unexpected = sorted(set(state) - set(targets))
    missing: list[str] = []
    mismatched: list[str] = []
    assignments: list[tuple[str, Tensor, Tensor]] = []
    for names in groups.values():
        present = [n for n in names if n in state]
        if not present:
            if any(n in allow_missing for n in names):
                logger.warning("%s has no weights for %s: keeping the fresh initialisation", source, names[0])
            else:
                missing.append(names[0] if len(names) == 1 else f"{names[0]} (tied with {', '.join(names[1:])})")
            continue
        loaded = state[present[0]]
        for other in present[1:]:
            if not torch.equal(state[other], loaded):
                raise ValueError(f"{source}: tied weights {present[0]} and {other} hold different values")
        target = targets[names[0]]
        if tuple(loaded.shape) != tuple(target.shape):
            mismatched.append(f"{present[0]}: checkpoint {tuple(loaded.shape)} vs model {tuple(target.shape)}")
        elif loaded.is_floating_point() != target.is_floating_point() or (
            not target.is_floating_point() and loaded.dtype != target.dtype
        ):
            # Integer tensors are never cast: int8 weights stored in a wider type are a different format.
            mismatched.append(f"{present[0]}: checkpoint dtype {loaded.dtype} vs model dtype {target.dtype}")
        else:
            assignments.append((present[0], target, loaded))
    if missing or unexpected or mismatched:
        problems = [
            f"{label} ({len(items)}): {_listing(items)}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched))
            if items
        ]
        raise ValueError(
            f"the weights in {source} do not fit {type(model).__name__} and its config: " + "; ".join(problems)
        )

    floating = [(name, loaded) for name, _, loaded in assignments if loaded.is_floating_point() and name not in packed]
    model_dtype = dtype if dtype is not None else _dominant_dtype([t for _, t in floating])
    if model_dtype is not None:
        model.to(dtype=model_dtype)  # non-persistent float buffers (sinusoid tables) follow the weights
        cast = [f"{name} ({str(t.dtype).removeprefix('torch.')})" for name, t in floating if t.dtype != model_dtype]
        if cast and dtype is None:
            logger.warning(
                "%s stores %d tensor(s) in another dtype than most of its weights; cast to %s: %s",
                source, len(cast), str(model_dtype).removeprefix("torch."), _listing(cast),
            )
    used_storages: set[int] = set()
    quantized = tuple(f"{name}." for name in quantized_modules(model))
    # Looked up again: casting replaces floating buffers (a quantized layer's scale) by new tensor objects, while
    # parameters keep theirs.
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, _, loaded in assignments:
            target = targets[name]
            if loaded.is_floating_point() and model_dtype is not None and name not in packed:
                loaded = loaded.to(dtype=model_dtype)
            loaded = loaded.to(device=target.device).contiguous()
            if name.startswith(quantized) and loaded.data_ptr() % _ALIGNMENT:
                # safetensors hands out views of one file buffer at 8-byte offsets; the CPU int8 kernel
                # (torch._weight_int8pack_mm, bfloat16 path) crashes with a segfault on an int8 weight that is not
                # 64-byte aligned. A copy gets an aligned block from the allocator.
                loaded = loaded.clone()
            if loaded.untyped_storage().data_ptr() in used_storages:
                # One tensor given for two untied parameters (a converter may do this): copy it, or training
                # one parameter would silently change the other.
                loaded = loaded.clone()
            used_storages.add(loaded.untyped_storage().data_ptr())
            # Assigning .data keeps the Parameter object, so every module sharing it stays tied.
            target.data = loaded


def _dominant_dtype(tensors: list[Tensor]) -> torch.dtype | None:
    """The floating dtype holding the most elements (ties: the wider one), or ``None`` without tensors."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    if not counts:
        return None
    return max(counts, key=lambda d: (counts[d], d.itemsize))


def _zoo_class_and_config(
    raw: dict[str, Any], expected_class: type[nn.Module] | None, source: str
) -> tuple[type[nn.Module], Any]:
    version = raw.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{source}: config.json has format_version={version!r}; expected a positive integer")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{source}: config.json has format_version={version}, newer than this transformer-zoo reads "
            f"({FORMAT_VERSION}); upgrade transformer-zoo"
        )
    name = raw.get("architecture")
    if not isinstance(name, str):
        raise ValueError(f"{source}: config.json has architecture={name!r}; expected a class name")
    if expected_class is not None:
        if name != expected_class.__name__:
            raise ValueError(
                f"{source} holds a {name} checkpoint, not a {expected_class.__name__}; load it with "
                f"{name}.from_pretrained or models.auto.from_pretrained"
            )
        cls = expected_class
    else:
        cls = get_architecture(name)
    config_dict = raw.get("config")
    if not isinstance(config_dict, dict):
        raise ValueError(f"{source}: config.json field 'config' must be an object, got {type(config_dict).__name__}")
    try:
        config = cls.config_class.from_dict(config_dict)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: config.json does not hold a valid {cls.config_class.__name__}: {e}") from e
    return cls, config


def _convert_transformers(
    raw: dict[str, Any], state: dict[str, Tensor], expected_class: type[nn.Module] | None, source: str
) -> tuple[type[nn.Module], Any, dict[str, Tensor], frozenset[str]]:
    converted = converters.from_transformers(raw, state)
    cls = converted.architecture
    if expected_class is not None and cls is not expected_class:
        raise ValueError(
            f"{source} is a transformers {raw.get('model_type')!r} checkpoint, which converts to {cls.__name__}, "
            f"not {expected_class.__name__}; load it with {cls.__name__}.from_pretrained or models.auto.from_pretrained"
        )
    return cls, converted.config, dict(converted.state_dict), frozenset(converted.allow_missing)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "zeros_", "ones_", "constant_", "xavier_uniform_",
                   "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")
_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _skipped_init() -> Iterator[None]:
    """``torch.nn.init``'s functions as no-ops while a model whose every weight will be loaded is built."""
    with _INIT_LOCK:
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        vars(nn.init).update(dict.fromkeys(_INIT_FUNCTIONS, lambda tensor, *args, **kwargs: tensor))
        try:
            yield
        finally:
            vars(nn.init).update(saved)


def _fetch_gguf(path_or_repo_id: str | os.PathLike[str], opts: ParsedOptions) -> Path:
    """``gguf_file`` of a local folder, or downloaded from a Hub repo with every part of its split set."""
    if Path(path_or_repo_id).expanduser().is_dir():
        return Path(path_or_repo_id).expanduser() / opts.gguf_file
    split = re.match(r"^(.*)-00001-of-(\d{5})\.gguf$", opts.gguf_file, re.IGNORECASE)  # parts lie beside the first
    names = [f"{split[1]}-{i:05d}-of-{split[2]}.gguf" for i in range(1, int(split[2]) + 1)] if split else []
    return [hub_download(str(path_or_repo_id), name, revision=opts.revision or "main", token=opts.token,
                         endpoint=opts.endpoint) for name in names or [opts.gguf_file]][0]


def _listing(items: list[str], limit: int = 20) -> str:
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
