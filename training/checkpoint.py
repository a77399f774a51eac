"""The files of a trainer checkpoint, written so that a kill at any instant leaves a loadable one.

A checkpoint folder ``step-NNNNNNNN`` holds

- ``sharded/``: the trainable parameters and the optimiser's tensors as a ``torch.distributed.checkpoint``
  (DCP) checkpoint: every process writes its own shards, and any number of processes, sharded any way
  (DDP, FSDP2, tensor parallel, one plain process), reads back the slices it holds;
- ``trainer_state.pt``: everything else (step, data position, optimiser hyper-parameters, scheduler,
  history, and the run's shape, checked on resume), plain data loaded with ``weights_only=True``;
- ``rng-rankR.pt``: each process's random state;
- ``manifest.json``: every other file's size and SHA-256, written last, so damage is found and named
  before anything is restored; a file it does not list, or a name it lists outside the folder, is refused.

DCP stores its index (``sharded/.metadata``) as a pickle; it is read here with an unpickler that builds only
DCP's own metadata classes, so a crafted checkpoint cannot run code, and every file name, offset and shape in it
is checked (names through ``models.checkpoints.paths.confined``) before DCP reads a byte. DCP's own
``CheckpointException`` (a ``BaseException``) never leaves this module: reads and writes raise ``ValueError``
(bad content) or ``OSError`` (I/O, naming the folder).

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
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from models.checkpoints import atomic
from models.checkpoints.atomic import fsync
from models.checkpoints.files import read_json
from models.checkpoints.paths import confined

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported when used: it takes seconds to import
    from torch.distributed.checkpoint.metadata import Metadata

FORMAT_VERSION = 2
CHECKPOINT_PREFIX = "step-"
STATE_NAME = "trainer_state.pt"
MANIFEST_NAME = "manifest.json"
SHARDED_DIR = "sharded"
# What interrupted saves of earlier transformer-zoo versions left: .step-N.tmp, .step-N.replaced, .step-N.<id>.deleting
_OLD_LEFTOVER = re.compile(rf"\.(?P<name>{CHECKPOINT_PREFIX}\d+)(?P<kind>\.tmp|\.replaced|\.[0-9a-f]{{8}}\.deleting)")
_SHA256 = re.compile(r"[0-9a-f]{64}")


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

    with _single_process_is_intended(), _dcp_errors(folder, "write"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=not _in_process_group())


def load_sharded(targets: dict[str, Tensor], folder: Path) -> None:
    """Fill ``targets`` (tensors or DTensors of the right global shapes) in place from a DCP folder.

    Raises:
        ValueError: the folder's content does not load (a bad index, a damaged shard) on any process.
        OSError: a file could not be read (the message names the folder).
    """
    import torch.distributed.checkpoint as dcp

    with _single_process_is_intended(), _dcp_errors(folder, "read"):
        dcp.load(targets, storage_reader=_safe_reader(folder), no_dist=not _in_process_group())


@contextlib.contextmanager
def _dcp_errors(folder: Path, action: str) -> Iterator[None]:
    """Turn DCP's failures (its ``CheckpointException`` is a ``BaseException`` that carries every process's error)
    into ``OSError`` where any process failed on I/O, ``ValueError`` otherwise; both name ``folder``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, Exception) as err:
        if isinstance(err, CheckpointException):
            causes = [pair[0] if isinstance(pair, tuple) else pair for pair in err.failures.values()]
        else:
            causes = [err]
        detail = "; ".join(f"{type(c).__name__}: {c}" for c in causes)[:2000]
        kind = OSError if any(isinstance(c, OSError) for c in causes) else ValueError
        raise kind(f"cannot {action} the sharded checkpoint {folder}: {detail}") from err


def _in_process_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one plain process is a supported case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_metadata(folder: Path) -> Metadata:
    """The DCP index of ``folder`` (``.metadata``), unpickled with DCP's own classes only, and checked: every
    tensor entry has a shape, a dtype and chunks inside that shape, and every storage entry names (by its
    ``relative_path``) a file inside ``folder`` and a byte range inside that file.

    Raises:
        ValueError: the file is missing, damaged, asks for any other object, or holds a bad entry (named).
        OSError: the file could not be read.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError as err:
        raise ValueError(f"{path} (the checkpoint index) is missing") from err
    except OSError:
        raise
    except Exception as err:  # pickle raises UnpicklingError, EOFError, TypeError, RecursionError, ... on junk
        raise ValueError(f"{path} is not a readable checkpoint index: {type(err).__name__}: {err}") from err
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} is not a checkpoint index (it holds a {type(metadata).__name__})")
    _check_tensor_entries(metadata, path)
    _check_storage_entries(metadata, folder, path)
    return metadata


def _check_tensor_entries(metadata: Metadata, path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: state_dict_metadata must be a dict, got a {type(entries).__name__}")
    for key, md in entries.items():
        if not isinstance(key, str) or not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise ValueError(f"{path}: state_dict_metadata entry {key!r} must name tensor or bytes metadata, "
                             f"got a {type(md).__name__}")
        if isinstance(md, BytesStorageMetadata):
            continue
        size = md.size
        if not isinstance(size, torch.Size) or any(d < 0 for d in size) or not isinstance(
                getattr(md.properties, "dtype", None), torch.dtype):
            raise ValueError(f"{path}: the size or dtype of {key!r} is not a shape of sizes >= 0 and a torch dtype: "
                             f"{size!r}")
        for chunk in md.chunks if isinstance(md.chunks, list) else [None]:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (isinstance(offsets, torch.Size) and isinstance(sizes, torch.Size)
                    and len(offsets) == len(sizes) == len(size)
                    and all(0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True))):
                raise ValueError(f"{path}: the chunks of {key!r} must lie inside its size {list(size)}, got {chunk!r}")


def _check_storage_entries(metadata: Metadata, folder: Path, path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    entries = metadata.storage_data
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: storage_data must be a dict, got a {type(entries).__name__}")
    sizes: dict[str, int] = {}
    for index, info in entries.items():
        fqn = index.fqn if isinstance(index, MetadataIndex) else index
        what = f"{path}: the relative_path of the storage entry for {fqn!r}"
        relative = getattr(info, "relative_path", None)
        file = confined(folder, relative, what)
        if relative not in sizes:
            try:
                info_stat = os.stat(file, follow_symlinks=False)
            except FileNotFoundError:
                raise ValueError(f"{what} names {relative!r}, which is not in {folder}") from None
            if not stat.S_ISREG(info_stat.st_mode):
                raise ValueError(f"{what} names {relative!r}, which is not a regular file")
            sizes[relative] = info_stat.st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)) \
                or offset + length > sizes[relative]:
            raise ValueError(f"{path}: the offset and length of the storage entry for {fqn!r} must be integers >= 0 "
                             f"inside {relative!r} ({sizes[relative]} bytes), got {offset!r} and {length!r}")
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{path}: the storage entry for {fqn!r} asks for the transforms "
                             f"{info.transform_descriptors!r}; trainer checkpoints are written without any")


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
    """Record every file below ``folder`` (size and SHA-256) in ``manifest.json``, flushed to disk.

    Args:
        folder: the checkpoint folder.
    """
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
    """Every problem with the files of checkpoint ``folder``, each naming its file (empty: all intact).

    The manifest must list every file of the folder (an unlisted file, a link or anything but a regular file is a
    problem), each under a name inside the folder (``confined``) with its size and SHA-256. Names that lead out
    of the folder are refused before anything is read; only listed files that exist are hashed.

    Raises:
        OSError: a file could not be read (other than a missing manifest, which is a problem).
    """
    path = folder / MANIFEST_NAME
    try:
        manifest = read_json(path)  # depth-limited (MAX_JSON_DEPTH) before parsing
    except FileNotFoundError:
        return [f"{path} is missing (not a checkpoint folder, a checkpoint of another version, or an unfinished one)"]
    except ValueError as err:  # not UTF-8, not JSON, not an object, nested too deeply
        return [f"{path} is damaged: {err}"]
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format_version") != FORMAT_VERSION:
        return [f"{path} is not a manifest of format {FORMAT_VERSION}: expected an object with format_version "
                f"{FORMAT_VERSION} and files {{name: {{bytes, sha256}}}}"]
    present, problems = _folder_files(folder)
    for name, entry in files.items():
        try:
            file = confined(folder, name, f"{path}: the files entry")
        except ValueError as err:
            problems.append(str(err))
            continue
        size, digest = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(digest, str) \
                or not _SHA256.fullmatch(digest):
            problems.append(f"{path}: the files entry {name!r} must be {{bytes: an integer >= 0, sha256: 64 hex "
                            f"digits}}, got {str(entry)[:200]}")
        elif name not in present:
            problems.append(f"{file} is missing")
        elif present[name] != size:
            problems.append(f"{file} is damaged: {present[name]} bytes, {size} were written")
        elif _sha256(file) != digest:
            problems.append(f"{file} is damaged: its SHA-256 differs from the one recorded when it was written")
    problems += [f"{folder / name} is not listed in {path}: a checkpoint holds only the files its manifest lists"
                 for name in sorted(set(present) - set(files))]
    return problems


def _folder_files(folder: Path) -> tuple[dict[str, int], list[str]]:
    """``relative name -> size`` of every regular file below ``folder`` but the manifest (links are not
    followed), and one problem per link or other non-regular entry."""
    present, problems = {}, []
    for top, dirs, names in os.walk(folder, followlinks=False):
        for name in sorted(dirs + names):
            entry = Path(top) / name
            mode = os.lstat(entry).st_mode
            relative = entry.relative_to(folder).as_posix()
            if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                problems.append(f"{entry} is a link or a special file: a checkpoint holds only regular files")
            elif stat.S_ISREG(mode) and relative != MANIFEST_NAME:
                present[relative] = os.lstat(entry).st_size
    return present, problems


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
    """``torch.load(weights_only=True)``: a missing or damaged file becomes a ``ValueError`` naming it, an I/O
    failure stays an ``OSError`` (naming it)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise ValueError(f"{path} ({what}) is missing") from err
    except OSError:
        raise
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
    listed as a checkpoint.

    Args:
        folder: the checkpoint folder.
    """
    atomic.remove_folder(folder)


def recover(root: Path) -> None:
    """Finish or undo interrupted saves in ``root``: put back a checkpoint renamed aside whose replacement
    never arrived, and delete staging, replaced and half-deleted leftovers.

    Args:
        root: the checkpoint directory (nothing is done when it does not exist).
    """
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
    """Checkpoint folders in ``directory``, oldest first (empty if there is none).

    Args:
        directory: a Trainer's ``checkpoint_dir``.

    Returns:
        The ``step-NNNNNNNN`` folders.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))
