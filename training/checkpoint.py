"""The files of a trainer checkpoint, written so that a kill at any instant leaves a loadable one.

A checkpoint folder ``step-NNNNNNNN`` holds

- ``sharded/``: the trainable parameters and the optimiser's tensors as a ``torch.distributed.checkpoint``
  (DCP) checkpoint: every process writes its own shards, and any number of processes, sharded any way
  (DDP, FSDP2, tensor parallel, one plain process), reads back the slices it holds;
- ``trainer_state.pt``: everything else (step, data position, optimiser hyper-parameters, scheduler,
  history, and the run's shape, checked on resume), plain data loaded with ``weights_only=True``;
- ``rng-rankR.pt``: each process's random state;
- ``manifest.json``: every other file's size and SHA-256, written last, so damage is found and named
  before anything is restored.

DCP stores its index (``sharded/.metadata``) as a pickle; it is read here with an unpickler that builds only
DCP's own metadata classes, so a crafted checkpoint cannot run code.

Writes go to a hidden folder that is renamed into place; a replaced or pruned folder is first renamed
aside, so every instant of a save leaves the previous or the new checkpoint whole, and the next save or
load finishes or undoes what an interrupted one left. The scheme is the one model checkpoints use
(``models.checkpoints.atomic``: ``replace_folder``, ``remove_folder``, ``recover``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from models.checkpoints import atomic
from models.checkpoints.atomic import fsync

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported when used: it takes seconds to import
    from torch.distributed.checkpoint.metadata import Metadata

FORMAT_VERSION = 2
CHECKPOINT_PREFIX = "step-"
STATE_NAME = "trainer_state.pt"
MANIFEST_NAME = "manifest.json"
SHARDED_DIR = "sharded"
# What interrupted saves of earlier transformer-zoo versions left: .step-N.tmp, .step-N.replaced, .step-N.<id>.deleting
_OLD_LEFTOVER = re.compile(rf"\.(?P<name>{CHECKPOINT_PREFIX}\d+)(?P<kind>\.tmp|\.replaced|\.[0-9a-f]{{8}}\.deleting)")


def rng_name(rank: int) -> str:
    return f"rng-rank{rank}.pt"


# ---------------------------------------------------------------------------------------------- contents
def trainable_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every trainable parameter (a tied parameter under its first name)."""
    return {id(p): name for name, p in model.named_parameters() if p.requires_grad}


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """What goes into DCP: ``model/<name>`` for each trainable parameter and ``optim/<name>/<key>`` for
    each tensor of the optimiser's per-parameter state (DTensor shards where the model is sharded)."""
    names = trainable_names(model)
    state: dict[str, Tensor] = {f"model/{name}": p.detach() for name, p in model.named_parameters() if p.requires_grad}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            if isinstance(value, Tensor):
                state[f"optim/{names[id(param)]}/{key}"] = value
    return state


def optimizer_skeleton(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimiser's state dict without its tensors, parameters named instead of numbered:
    ``{"param_groups": [{..., "params": [names]}], "extra": {name: {key: non-tensor value}}}``."""
    names = trainable_names(model)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    extra = {names[id(p)]: {k: v for k, v in values.items() if not isinstance(v, Tensor)}
             for p, values in optimizer.state.items()}
    return {"param_groups": groups, "extra": {k: v for k, v in extra.items() if v}}


def write_sharded(state: dict[str, Tensor], folder: Path) -> None:
    """Write ``state`` with DCP (a collective inside a process group: every process writes its shards)."""
    import torch.distributed.checkpoint as dcp

    with _single_process_is_intended():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=not _in_process_group())


def load_sharded(targets: dict[str, Tensor], folder: Path) -> None:
    """Fill ``targets`` (tensors or DTensors of the right global shapes) in place from a DCP folder."""
    import torch.distributed.checkpoint as dcp

    with _single_process_is_intended():
        dcp.load(targets, storage_reader=_safe_reader(folder), no_dist=not _in_process_group())


def _in_process_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one plain process is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_metadata(folder: Path) -> Metadata:
    """The DCP index of ``folder`` (``.metadata``), unpickled with DCP's own classes only.

    Raises:
        ValueError: the file is missing, damaged, or asks for any other object.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError, IndexError) as err:
        raise ValueError(f"{path} is not a readable checkpoint index: {err}") from err
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} is not a checkpoint index (it holds a {type(metadata).__name__})")
    return metadata


def tensor_shapes(metadata: Metadata) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``key -> (global shape, dtype)`` of every tensor in a DCP index (non-tensor entries are left out)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: (md.size, md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _safe_reader(folder: Path) -> Any:
    """DCP's file reader, reading the index with ``read_metadata`` (no free unpickling)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata = read_metadata(Path(self.path))
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata classes, torch dtypes and paths; refuses every other global (Python docs,
    ``pickle`` — "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a checkpoint index")


# ---------------------------------------------------------------------------------------------- manifest
def write_manifest(folder: Path) -> None:
    """Record every file below ``folder`` (size and SHA-256) in ``manifest.json``, flushed to disk."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        fsync(path)
        files[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"format_version": FORMAT_VERSION, "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    fsync(folder / MANIFEST_NAME)
    for sub in {p.parent for p in folder.rglob("*")} | {folder}:
        fsync(sub)


def verify_manifest(folder: Path) -> list[str]:
    """Every problem with the files of checkpoint ``folder``, each naming its file (empty: all intact)."""
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest["format_version"] != FORMAT_VERSION or not isinstance(files, dict):
            raise ValueError(f"format_version {manifest['format_version']!r}, expected {FORMAT_VERSION}")
    except FileNotFoundError:
        return [f"{path} is missing (not a checkpoint folder, a checkpoint of another version, or an unfinished one)"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{path} is damaged: {err}"]
    problems = []
    for name, entry in files.items():
        file = folder / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != entry.get("bytes"):
            problems.append(f"{file} is damaged: {file.stat().st_size} bytes, {entry.get('bytes')} were written")
        elif _sha256(file) != entry.get("sha256"):
            problems.append(f"{file} is damaged: its SHA-256 differs from the one recorded when it was written")
    return problems


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` then flush to disk."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
        f.flush()
        os.fsync(f.fileno())


def load_torch(path: Path, what: str) -> Any:
    """``torch.load(weights_only=True)``; any failure becomes a ``ValueError`` naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise ValueError(f"{path} ({what}) is missing") from err
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError ... for a damaged file
        raise ValueError(f"{path} ({what}) is damaged: {type(err).__name__}: {err}") from err


# ---------------------------------------------------------------------------------------------- folders
def staging_folder(root: Path, name: str) -> Path:
    """The hidden folder a checkpoint ``name`` is written to before it is renamed into place: the same path in
    every process (each writes its shards there); the main process creates it after ``recover``."""
    return atomic.shared_staging_folder(root / name)


def publish(staging: Path, final: Path) -> None:
    """Make the finished ``staging`` folder the checkpoint ``final``, replacing an existing one as a whole:
    ``final`` (or the old one renamed aside, which ``recover`` puts back) is always whole."""
    atomic.replace_folder(staging, final)


def remove(folder: Path) -> None:
    """Delete a checkpoint folder: renamed to a hidden name first (atomic), so a half-deleted folder is never
    listed as a checkpoint."""
    atomic.remove_folder(folder)


def recover(root: Path) -> None:
    """Finish or undo interrupted saves in ``root``: put back a checkpoint renamed aside whose replacement
    never arrived, and delete staging, replaced and half-deleted leftovers."""
    if not root.is_dir():
        return
    atomic.recover_all(root, CHECKPOINT_PREFIX)
    for path in root.iterdir():  # leftovers of earlier versions, which named them differently
        old = _OLD_LEFTOVER.fullmatch(path.name)
        if old is None or not path.is_dir():
            continue
        if old["kind"] == ".replaced" and not (root / old["name"]).exists():
            os.rename(path, root / old["name"])  # the kill came between the two renames of the old publish
        else:
            shutil.rmtree(path, ignore_errors=True)
    fsync(root)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint folders in ``directory``, oldest first (empty if there is none)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))
