"""Checkpoint files on disk and on the Hub: find them, read them safely, write a folder atomically.

A checkpoint folder holds ``config.json``, ``model.safetensors`` (or sharded ``model-*.safetensors`` with
``model.safetensors.index.json``), optionally ``tokenizer.json`` and a ``README.md`` model card. The only
pickle ever read is ``pytorch_model.bin``, through ``torch.load(weights_only=True)``, which refuses anything
that is not plain tensors. Hub files are fetched and cached by ``huggingface_hub``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"  # special-token roles, written beside tokenizer.json
CARD_NAME = "README.md"
FORMAT_VERSION = 1
LIBRARY_NAME = "transformer-zoo"

WeightsFormat = Literal["safetensors", "sharded", "pickle"]


@dataclass(frozen=True)
class CheckpointFiles:
    """Where a checkpoint's files are on the local disk (a folder, or the Hub cache).

    ``source`` names the checkpoint in messages (a path, or ``repo_id@revision``); ``commit`` is the Hub
    commit the files come from (``None`` for a local folder).
    """

    source: str
    config: Path
    weights: tuple[Path, ...]
    weights_format: WeightsFormat
    index: Path | None = None
    tokenizer: Path | None = None
    commit: str | None = None


def library_version() -> str:
    """The installed transformer-zoo version (``"unknown"`` when run from an uninstalled checkout)."""
    try:
        return metadata.version(LIBRARY_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


def is_zoo_config(raw: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` was written by transformer-zoo."""
    return "architecture" in raw and "format_version" in raw


def is_transformers_config(raw: dict[str, Any]) -> bool:
    """Whether a parsed ``config.json`` was written by ``transformers`` (it names a ``model_type``)."""
    return "model_type" in raw and not is_zoo_config(raw)


# ---------------------------------------------------------------------------------------------- writing
def unique_state(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict on CPU with every tied tensor stored once, under its first name.

    Shapes: each tensor keeps its shape and dtype.
    """
    out: dict[str, Tensor] = {}
    seen_objects: set[int] = set()
    seen_storages: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen_objects:
            continue  # a tied alias: the model re-ties it when it is built
        seen_objects.add(id(tensor))
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
    """
    save_file(state, str(path), metadata={"format": "pt"})


def write_json(obj: dict[str, Any], path: Path) -> None:
    """Write ``obj`` as indented JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


@contextmanager
def staging_folder(target: Path) -> Iterator[Path]:
    """A fresh folder next to ``target`` (same filesystem, so moves are atomic renames), removed on exit."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.saving"
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, target: Path) -> None:
    """Move every file of ``staging`` into ``target`` so that ``target`` is never half-written.

    A new ``target`` is one atomic rename of the whole folder. An existing one has each file replaced
    atomically, ``config.json`` last, after hard-linking the old files aside; any exception while moving
    puts the old files back, so the previous checkpoint stays loadable. Other files in ``target`` are kept.

    Raises:
        NotADirectoryError: ``target`` exists and is not a folder.
    """
    names = sorted((p.name for p in staging.iterdir()), key=lambda n: (n == CONFIG_NAME, n))
    for name in names:
        _fsync(staging / name)
    if not target.exists():
        os.rename(staging, target)
        _fsync(target.parent)
        return
    if not target.is_dir():
        raise NotADirectoryError(f"cannot save a checkpoint to {target}: it exists and is not a folder")
    backup = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.backup"
    backup.mkdir()
    moved: list[tuple[str, bool]] = []
    try:
        for name in names:
            dest = target / name
            had_old = dest.exists()
            if had_old:
                _link_or_copy(dest, backup / name)
            os.replace(staging / name, dest)
            moved.append((name, had_old))
    except BaseException:
        for name, had_old in reversed(moved):
            if had_old:
                os.replace(backup / name, target / name)
            else:
                (target / name).unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(backup, ignore_errors=True)
    _fsync(target)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # filesystems without hard links
        shutil.copy2(src, dst)


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk (best effort: some platforms cannot open folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- reading
def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object from ``path``.

    Raises:
        ValueError: the file is not valid UTF-8 JSON or not an object (the path is named).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_weights(files: CheckpointFiles) -> dict[str, Tensor]:
    """All tensors of a checkpoint, on CPU, in the checkpoint's own names and dtypes.

    Raises:
        ValueError: a corrupted or truncated safetensors file, an inconsistent shard index, or a pickle
            that ``torch.load(weights_only=True)`` refuses (it is never unpickled any other way).
    """
    if files.weights_format == "pickle":
        return _read_pickle(files.weights[0])
    if files.weights_format == "safetensors":
        return _read_safetensors(files.weights[0])
    assert files.index is not None
    weight_map = _weight_map(files.index)
    state: dict[str, Tensor] = {}
    for shard in files.weights:
        for name, tensor in _read_safetensors(shard).items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {files.source}")
            if weight_map.get(name) != shard.name:
                raise ValueError(f"{files.index} puts {name!r} in {weight_map.get(name)!r}, but it is in {shard.name}")
            state[name] = tensor
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise ValueError(f"{files.index} lists tensors that no shard holds: {absent}")
    return state


def shard_names(index: Path) -> list[str]:
    """The distinct shard files named by a ``model.safetensors.index.json``, in order of first use.

    Raises:
        ValueError: a malformed index, or a shard name that is not a plain file name in the same folder.
    """
    names = list(dict.fromkeys(_weight_map(index).values()))
    for name in names:
        if PurePosixPath(name).name != name or name in ("", ".", "..") or "\\" in name:
            raise ValueError(f"{index} names shard {name!r}; expected a file name in the checkpoint folder")
    return names


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{index} must have a 'weight_map' object of tensor name -> shard file name")
    return weight_map


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as e:
        raise ValueError(
            f"{path} is not a valid safetensors file ({e}); it is probably truncated or corrupted: save or "
            "download it again"
        ) from e


def _read_pickle(path: Path) -> dict[str, Tensor]:
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


# ---------------------------------------------------------------------------------------------- finding
@dataclass(frozen=True)
class Location:
    """A checkpoint whose ``config.json`` has been found: a local ``folder``, or Hub ``repo_id`` at ``commit``.

    Finding the config first lets a loader refuse a wrong checkpoint before downloading its weights.
    """

    source: str
    config: Path
    folder: Path | None = None
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    token: str | bool | None = None
    endpoint: str | None = None

    def fetch(self, filename: str) -> Path:
        """Download ``filename`` of the located commit into the ``huggingface_hub`` cache (Hub only)."""
        assert self.repo_id is not None and self.commit is not None
        return Path(hf_hub_download(
            self.repo_id, filename, revision=self.commit, token=self.token, endpoint=self.endpoint,
            library_name=LIBRARY_NAME, library_version=library_version(),
        ))

    def fetch_optional(self, filename: str) -> Path | None:
        try:
            return self.fetch(filename)
        except EntryNotFoundError:
            return None


def locate(
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> Location:
    """Find a checkpoint's ``config.json`` in a local folder, or download it from a Hub repo.

    Args:
        path_or_repo_id: an existing folder, or a Hub repo id.
        revision: Hub branch, tag or commit (default ``"main"``); not allowed with a local folder.
        token, endpoint: passed to ``huggingface_hub``.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: ``revision`` given with a local folder, or a path that is a file, not a folder.
        FileNotFoundError: a local folder without ``config.json``, or a path-like string that does not exist.
        huggingface_hub.errors.RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError: from the
            Hub, with the repo and revision added to the message.
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        raise TypeError(f"path_or_repo_id must be a folder path or a Hub repo id, got {type(path_or_repo_id).__name__}")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a branch, tag or commit string, got {type(revision).__name__}")
    path = Path(path_or_repo_id).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} only applies to Hub repos, but {path} is a local folder")
        if not path.is_dir():
            raise ValueError(f"{path} is a file; expected a checkpoint folder (holding {CONFIG_NAME} and weights)")
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; it holds {sorted(p.name for p in path.iterdir())}")
        return Location(source=str(path), config=path / CONFIG_NAME, folder=path)
    text = os.fspath(path_or_repo_id)
    if isinstance(path_or_repo_id, os.PathLike) or text.startswith((".", "~", "/")) or text.count("/") > 1:
        raise FileNotFoundError(f"no checkpoint folder at {text}")
    wanted = revision or "main"
    hub = Location(source=f"{text}@{wanted}", config=Path(), repo_id=text, revision=wanted, commit=wanted,
                   token=token, endpoint=endpoint)
    with _hub_context(hub):
        config = hub.fetch(CONFIG_NAME)
    # The cache keeps files under snapshots/<commit>/: every later file comes from that very commit, so a push
    # landing between two downloads cannot mix two checkpoints.
    commit = config.parent.name if _is_commit_sha(config.parent.name) else wanted
    return dataclasses.replace(hub, config=config, commit=commit)


def checkpoint_files(location: Location) -> CheckpointFiles:
    """The weights (``model.safetensors``, else the shards of ``model.safetensors.index.json``, else
    ``pytorch_model.bin``) and the optional ``tokenizer.json`` of a located checkpoint, downloaded if on the Hub.

    Raises:
        FileNotFoundError: a local folder without weights, or without a shard its index names.
        ValueError: a malformed shard index.
        huggingface_hub.errors.EntryNotFoundError: a Hub repo without weights (repo and revision named).
    """
    if location.folder is not None:
        return _local_files(location)
    with _hub_context(location):
        weights, weights_format, index = _fetch_weights(location)
        tokenizer = location.fetch_optional(TOKENIZER_NAME)
        if tokenizer is not None:
            location.fetch_optional(TOKENIZER_CONFIG_NAME)  # lands beside tokenizer.json in the snapshot
    return CheckpointFiles(
        source=location.source, config=location.config, weights=weights, weights_format=weights_format,
        index=index, tokenizer=tokenizer, commit=location.commit,
    )


def resolve_checkpoint(
    path_or_repo_id: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> CheckpointFiles:
    """``locate`` then ``checkpoint_files``: every file of a checkpoint, local or downloaded."""
    return checkpoint_files(locate(path_or_repo_id, revision=revision, token=token, endpoint=endpoint))


def _local_files(location: Location) -> CheckpointFiles:
    folder = location.folder
    assert folder is not None
    tokenizer = folder / TOKENIZER_NAME
    common = dict(source=location.source, config=location.config, tokenizer=tokenizer if tokenizer.is_file() else None)
    if (folder / WEIGHTS_NAME).is_file():
        return CheckpointFiles(weights=(folder / WEIGHTS_NAME,), weights_format="safetensors", **common)
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        shards = tuple(folder / name for name in shard_names(index))
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are not in {folder}: {absent}")
        return CheckpointFiles(weights=shards, weights_format="sharded", index=index, **common)
    if (folder / PICKLE_WEIGHTS_NAME).is_file():
        return CheckpointFiles(weights=(folder / PICKLE_WEIGHTS_NAME,), weights_format="pickle", **common)
    raise FileNotFoundError(
        f"{folder} has no weights: expected {WEIGHTS_NAME}, {WEIGHTS_INDEX_NAME} or {PICKLE_WEIGHTS_NAME} "
        f"(other pickles such as .pt/.ckpt are never loaded); it holds {sorted(p.name for p in folder.iterdir())}"
    )


def _fetch_weights(location: Location) -> tuple[tuple[Path, ...], WeightsFormat, Path | None]:
    single = location.fetch_optional(WEIGHTS_NAME)
    if single is not None:
        return (single,), "safetensors", None
    index = location.fetch_optional(WEIGHTS_INDEX_NAME)
    if index is not None:
        return tuple(location.fetch(name) for name in shard_names(index)), "sharded", index
    try:
        return (location.fetch(PICKLE_WEIGHTS_NAME),), "pickle", None
    except EntryNotFoundError as e:
        _append_to_message(
            e, f"\nno weights found: looked for {WEIGHTS_NAME}, {WEIGHTS_INDEX_NAME} and {PICKLE_WEIGHTS_NAME}"
        )
        raise


@contextmanager
def _hub_context(location: Location) -> Iterator[None]:
    """Name the repo and the requested revision in the Hub's not-found errors."""
    try:
        yield
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        _append_to_message(
            e, f"\n[transformer-zoo: loading Hub repo {location.repo_id!r} at revision {location.revision!r}]"
        )
        raise


def _is_commit_sha(text: str) -> bool:
    return len(text) == 40 and all(c in "0123456789abcdef" for c in text)


def _append_to_message(error: BaseException, extra: str) -> None:
    """Add ``extra`` to an exception's message in place (``huggingface_hub`` errors and plain ones alike)."""
    if error.args and isinstance(error.args[0], str):
        error.args = (error.args[0] + extra, *error.args[1:])
    else:
        error.args = (*error.args, extra.strip())
