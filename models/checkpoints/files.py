"""A checkpoint folder's files: their names, ``config.json``, the weights and the tokenizer, read and written.

A checkpoint folder holds ``config.json``, ``model.safetensors`` (or sharded ``model-*.safetensors`` with
``model.safetensors.index.json``), optionally ``tokenizer.json`` and a ``README.md`` model card. The only
pickle ever read is ``pytorch_model.bin``, through ``torch.load(weights_only=True)``, which refuses anything
that is not plain tensors. Finding the files (a folder or the Hub) is ``models.checkpoints.locate``; writing a
folder atomically is ``models.checkpoints.atomic``.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

import blocks

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"  # special-token roles, written beside tokenizer.json
CHAT_TEMPLATE_NAME = "chat_template.jinja"  # the tokenizer's chat template, beside tokenizer.json
CARD_NAME = "README.md"
FORMAT_VERSION = 1
#: the top-level ``config.json`` key recording a quantized checkpoint's scheme and layers (see
#: ``models.checkpoints.persistence``).
QUANTIZATION_KEY = "quantization"
#: the top-level ``config.json`` key recording the ``transformers`` family a converted model came from.
SOURCE_FAMILY_KEY = "transformers_model_type"
LIBRARY_NAME = "transformer-zoo"
#: How deeply the JSON files of a checkpoint (config, shard index, adapter config) may nest objects and arrays.
#: Real ones nest under 10 levels; Python's parser would recurse once per level and fail with RecursionError.
MAX_JSON_DEPTH = 64
#: How large a checkpoint's JSON file may be (checked before it is read): real configs are kilobytes, shard indexes
#: of the largest models ~10 MB; a 20 MB ``id2label`` would take seconds to parse before it could be refused.
MAX_JSON_BYTES = 32 << 20
#: How large a model's ``config.json`` may be (the largest label maps published, ~22k ImageNet classes, take ~1 MB).
MAX_CONFIG_BYTES = 4 << 20

WeightsFormat = Literal["safetensors", "sharded", "pickle"]


@dataclass(frozen=True)
class CheckpointFiles:
    """Where a checkpoint's files are on the local disk (a folder, or the Hub cache).

    Attributes:
        source: names the checkpoint in messages (a path, or ``repo_id@revision``).
        config: its ``config.json``.
        weights: its weights files (one, or the shards in order).
        weights_format: ``"safetensors"``, ``"sharded"`` or ``"pickle"``.
        index: the shard index (``"sharded"``), else None.
        tokenizer: its ``tokenizer.json``, or None.
        commit: the Hub commit the files come from (None for a local folder).
    """

    source: str
    config: Path
    weights: tuple[Path, ...]
    weights_format: WeightsFormat
    index: Path | None = None
    tokenizer: Path | None = None
    commit: str | None = None


def library_version() -> str:
    """The installed transformer-zoo version (``"unknown"`` when run from an uninstalled checkout).

    Returns:
        The version string.
    """
    try:
        return metadata.version(LIBRARY_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


def is_zoo_config(raw: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` was written by transformer-zoo.

    Args:
        raw: the parsed ``config.json``.

    Returns:
        True when it has ``architecture`` and ``format_version``.
    """
    return "architecture" in raw and "format_version" in raw


def is_transformers_config(raw: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` was written by ``transformers`` (it names a ``model_type``).

    Args:
        raw: the parsed ``config.json``.

    Returns:
        True when it names a ``model_type`` and is not a zoo config.
    """
    return "model_type" in raw and not is_zoo_config(raw)


# ---------------------------------------------------------------------------------------------- writing
def unique_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict on CPU with every tied tensor stored once, under its first name.

    Args:
        model: the model (a sharded model's DTensors are gathered: every rank must call this).

    Returns:
        Name -> contiguous CPU tensor.

    Shapes: each tensor keeps its shape and dtype.
    """
    out: dict[str, Tensor] = {}
    seen_objects: set[int] = set()
    seen_storages: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen_objects:
            continue  # a tied alias: the model re-ties it when it is built
        seen_objects.add(id(tensor))
        if hasattr(tensor, "full_tensor"):  # a DTensor of a sharded model: gather it (every rank must call this)
            tensor = tensor.full_tensor()
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen_storages:
            tensor = tensor.clone()  # distinct tensors that are views of one buffer: safetensors wants them apart
        seen_storages.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor.contiguous()
    return out


def save_weights(state: dict[str, Tensor], path: Path) -> None:
    """Write ``state`` to a safetensors file with ``format: pt`` metadata (as ``transformers`` expects).

    Only one metadata key, because safetensors writes metadata in hash-map order: with more, saving the same
    weights twice could give different bytes, and an unchanged model would make a new Hub commit.

    Raises:
        OSError: the write failed (a full disk, a file size limit, ...): safetensors' own ``SafetensorError`` is
            turned into the ``OSError`` it stands for, with its errno and the path.

    Args:
        state: name -> tensor (contiguous, on CPU, no two sharing memory: ``unique_state``).
        path: the file to write.

    Shapes: each tensor as stored (any shape).
    """
    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code[1]) if code else errno.EIO, f"writing the weights failed ({e})", str(path)) from e


def write_json(obj: dict[str, Any], path: Path) -> None:
    """Write ``obj`` as indented JSON with a trailing newline.

    Args:
        obj: the JSON object.
        path: the file to write.
    """
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------- reading
def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """Parse a JSON object from ``path``; every JSON file of a checkpoint is read here.

    Args:
        path: the file.
        max_bytes: the largest file read (``MAX_JSON_BYTES``; ``MAX_CONFIG_BYTES`` for a model's ``config.json``).

    Returns:
        The parsed object.

    Raises:
        ValueError: the file is larger than ``max_bytes`` (checked before reading), not valid UTF-8 JSON, not an
            object, or nests objects and arrays deeper than ``MAX_JSON_DEPTH`` (checked before parsing; the path
            is named).
    """
    size = Path(path).stat().st_size
    if size > max_bytes:
        raise ValueError(f"{path} holds {size:,} bytes of JSON; expected at most {max_bytes:,}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"{path} nests JSON objects and arrays {depth} levels deep; expected at most {MAX_JSON_DEPTH}"
        )
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:  # ValueError: e.g. an integer of too many digits
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


_JSON_STRUCTURE = re.compile(r'[\[\]{}"\\]')


def json_depth(text: str) -> int:
    """How deeply ``text`` nests JSON arrays and objects (brackets inside strings do not count), in one linear
    pass that never recurses, so it is safe on any input, valid JSON or not.

    Args:
        text: the JSON text.

    Returns:
        The deepest nesting (0 for a scalar).
    """
    depth = deepest = 0
    in_string = False
    skip = -1  # the index of a character escaped by a backslash
    for match in _JSON_STRUCTURE.finditer(text):
        char, at = match[0], match.start()
        if at == skip:
            continue
        if in_string:
            if char == "\\":
                skip = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def load_tokenizer(path: Path) -> Any:
    """Load a checkpoint's ``tokenizer.json`` as a ``tokenization.Tokenizer`` (special-token roles come from a
    ``tokenizer_config.json`` beside it, when present).

    Args:
        path: the ``tokenizer.json`` file.

    Returns:
        The tokenizer.

    Raises:
        ValueError: the file is not a valid tokenizer (the path is named).
    """
    from tokenization import Tokenizer  # imported here: models must not need tokenization to import

    return Tokenizer.from_file(path)


def read_weights(files: CheckpointFiles) -> dict[str, Tensor]:
    """All tensors of a checkpoint, on CPU, in the checkpoint's own names and dtypes.

    Args:
        files: the checkpoint's files.

    Returns:
        Name -> tensor.

    Raises:
        ValueError: a corrupted or truncated safetensors file, an inconsistent shard index, or a pickle
            that ``torch.load(weights_only=True)`` refuses (it is never unpickled any other way).

    Shapes: each tensor as stored (any shape).
    """
    if files.weights_format == "pickle":
        return read_pickle(files.weights[0])
    if files.weights_format == "safetensors":
        return read_safetensors(files.weights[0])
    assert files.index is not None
    weight_map = _weight_map(files.index)
    state: dict[str, Tensor] = {}
    for shard in files.weights:
        shard_name = Path(os.path.relpath(shard, files.index.parent)).as_posix()  # as the index names it
        for name, tensor in read_safetensors(shard).items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {files.source}")
            if weight_map.get(name) != shard_name:
                raise ValueError(f"{files.index} puts {name!r} in {weight_map.get(name)!r}, but it is in {shard_name}")
            state[name] = tensor
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise ValueError(f"{files.index} lists tensors that no shard holds: {absent}")
    return state


def shard_names(index: Path) -> list[str]:
    """The distinct shard files named by a ``model.safetensors.index.json``, in order of first use, as written
    there: names read from a file, which the caller joins to the folder through ``paths.confined``.

    Args:
        index: the ``model.safetensors.index.json`` file.

    Returns:
        The shard file names.

    Raises:
        ValueError: a malformed index.
    """
    return list(dict.fromkeys(_weight_map(index).values()))


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{index} must have a 'weight_map' object of tensor name -> shard file name")
    return weight_map


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file, on CPU.

    Args:
        path: the file.

    Returns:
        Name -> tensor.

    Raises:
        ValueError: a truncated or corrupted file (the path is named).
        OSError: the file cannot be read (``FileNotFoundError`` included).

    Shapes: each tensor as stored (any shape).
    """
    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as e:
        raise ValueError(
            f"{path} is not a valid safetensors file ({e}); it is probably truncated or corrupted: save or "
            "download it again"
        ) from e
    except FileNotFoundError:
        raise
    except OSError as e:  # e.g. a folder where the file should be: safetensors does not name the path
        raise OSError(e.errno, f"cannot read the weights ({e})", str(path)) from e


def read_pickle(path: Path) -> dict[str, Tensor]:
    """The tensors of a PyTorch pickle (``pytorch_model.bin``, ``adapter_model.bin``), read with
    ``torch.load(weights_only=True)``: never unpickled any other way.

    Args:
        path: the file.

    Returns:
        Name -> tensor.

    Raises:
        ValueError: a pickle holding more than a flat dict of tensors, or an unreadable file (the path is named).

    Shapes: each tensor as stored (any shape).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"refusing to load {path}: torch.load(weights_only=True) rejected it ({reason}), so it holds more than "
            "plain tensors and unpickling it could run arbitrary code; convert it to safetensors from a trusted source"
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path} is not a readable PyTorch checkpoint: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise ValueError(f"{path} must hold a flat dict of tensor name -> tensor, got {type(state).__name__}")
    return state


def quantization_entry(raw: dict[str, Any], source: str) -> tuple[dict[str, str], dict[str, dict[str, Any]]] | None:
    """The ``(layer name -> scheme, scheme -> options)`` of ``config.json``'s ``quantization`` entry, or ``None``
    when it has none (see ``models.checkpoints.persistence`` for the two forms).

    Checked before any weights are read or downloaded.

    Args:
        raw: the parsed ``config.json``.
        source: names the checkpoint in messages.

    Returns:
        ``(layer name -> scheme, scheme -> options)``, or None when the model is not quantized.

    Raises:
        ValueError: a malformed entry (an object of ``scheme`` and a ``modules`` list, or of a ``modules`` object
            naming each layer's scheme; ``options`` optional), an unknown scheme, ``modules`` that is not a
            non-empty list of distinct names, or ``options`` that are not objects.
    """
    entry = raw.get(QUANTIZATION_KEY)
    if entry is None:
        return None
    where = f"{source}: config.json's {QUANTIZATION_KEY!r} entry"
    mixed = isinstance(entry, dict) and isinstance(entry.get("modules"), dict)
    expected = {"modules"} if mixed else {"scheme", "modules"}
    if not isinstance(entry, dict) or not expected <= set(entry) <= expected | {"options"}:
        got = sorted(entry) if isinstance(entry, dict) else entry
        raise ValueError(f"{where} must be an object with keys ['modules', 'scheme'], got {got!r} (an 'options' "
                         "object may be added; a mixed model gives a 'modules' object of layer name -> scheme)")
    layers = entry["modules"]
    if mixed:
        if not layers or not all(isinstance(n, str) and n for n in layers):
            raise ValueError(f"{where} must name the quantized layers in 'modules' (non-empty strings), got "
                             f"{sorted(layers)[:5]!r}")
        schemes = set(layers.values())
    else:
        if not isinstance(layers, list) or not layers or not all(isinstance(n, str) and n for n in layers):
            raise ValueError(f"{where} must list the quantized layers in 'modules' (non-empty strings), got "
                             f"{layers!r}")
        if len(set(layers)) != len(layers):
            twice = sorted({n for n in layers if layers.count(n) > 1})
            raise ValueError(f"{where} lists layers more than once: {twice}")
        schemes = {entry["scheme"]}
        layers = dict.fromkeys(layers, entry["scheme"])
    known = blocks.names("quantization")
    for scheme in sorted(schemes, key=repr):
        if scheme not in known:
            raise ValueError(f"{where} names quantization scheme {scheme!r}; this transformer-zoo knows {known}")
    options = entry.get("options", {})
    if not mixed and options:
        options = {entry["scheme"]: options}
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ValueError(f"{where} has 'options' {options!r}; expected an object of option names and values")
    return layers, options
