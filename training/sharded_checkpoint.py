"""The sharded part of a trainer checkpoint: trainable parameters and optimiser tensors through
``torch.distributed.checkpoint`` (DCP), and its index read without free unpickling.

Every process writes its own shards, and any number of processes, sharded any way (DDP, FSDP2, tensor parallel,
one plain process), reads back the slices it holds. DCP stores its index (``.metadata``) as a pickle; it is read
here with an unpickler that builds only DCP's own metadata classes, so a crafted checkpoint cannot run code, and
every file name, offset and shape in it is checked (names through ``models.checkpoints.paths.confined``) before DCP
reads a byte. DCP's ``CheckpointException`` (a ``BaseException``) never leaves this module: reads and writes raise
``ValueError`` (bad content) or ``OSError`` (I/O, naming the folder). ``training.checkpoint`` re-exports the names.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from models.checkpoints.paths import confined

if TYPE_CHECKING:  # torch.distributed.checkpoint is imported when used: it takes seconds to import
    from torch.distributed.checkpoint.metadata import Metadata


# ---------------------------------------------------------------------------------------------- contents
def trainable_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every trainable parameter (a tied parameter under its first name).

    Args:
        model: the model being trained (sharded or not: the names are the unwrapped module's).

    Returns:
        The names by parameter identity: how optimiser state, which torch keys by parameter, gets a stable name.
    """
    return {id(p): name for name, p in model.named_parameters() if p.requires_grad}


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """What goes into DCP: ``model/<name>`` for each trainable parameter and ``optim/<name>/<key>`` for
    each tensor of the optimiser's per-parameter state (DTensor shards where the model is sharded).

    Args:
        model: the model being trained.
        optimizer: its optimiser (its state may be empty before the first step).

    Returns:
        The flat ``key -> tensor`` dict DCP saves, the tensors the live ones (not copies).

    Shapes: every tensor keeps its parameter's (global) shape; scalar optimiser state such as Adam's ``step`` is
    ``()``.
    """
    names = trainable_names(model)
    state: dict[str, Tensor] = {f"model/{name}": p.detach() for name, p in model.named_parameters() if p.requires_grad}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            if isinstance(value, Tensor):
                state[f"optim/{names[id(param)]}/{key}"] = value
    return state


def optimizer_skeleton(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimiser's state dict without its tensors, parameters named instead of numbered:
    ``{"param_groups": [{..., "params": [names]}], "extra": {name: {key: non-tensor value}}}``.

    Args:
        model: the model being trained.
        optimizer: its optimiser.

    Returns:
        The skeleton, plain data only (it goes into ``trainer_state.pt``; the tensors go into DCP).
    """
    names = trainable_names(model)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    extra = {names[id(p)]: {k: v for k, v in values.items() if not isinstance(v, Tensor)}
             for p, values in optimizer.state.items()}
    return {"param_groups": groups, "extra": {k: v for k, v in extra.items() if v}}


def write_sharded(state: dict[str, Tensor], folder: Path) -> None:
    """Write ``state`` with DCP (a collective inside a process group: every process writes its shards).

    Args:
        state: the flat ``key -> tensor`` dict (``sharded_state``).
        folder: the DCP folder (``<checkpoint>/sharded``).

    Raises:
        OSError: a process failed to write (the folder and every process's error are named).
        ValueError: DCP failed otherwise.

    Shapes: tensors or DTensors, saved at their global shapes.
    """
    import torch.distributed.checkpoint as dcp

    with _single_process_is_intended(), _dcp_errors(folder, "write"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=not _in_process_group())


def load_sharded(targets: dict[str, Tensor], folder: Path) -> None:
    """Fill ``targets`` (tensors or DTensors of the right global shapes) in place from a DCP folder.

    Args:
        targets: ``key -> tensor`` to fill, each holding this process's slice (``resume.load_targets``).
        folder: the DCP folder (``<checkpoint>/sharded``).

    Shapes: each target the global shape its key has in the index (``tensor_shapes``), sharded or not.

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

    Args:
        folder: the DCP folder (``<checkpoint>/sharded``).

    Returns:
        DCP's ``Metadata``, safe to hand to DCP's reader.

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
    """``key -> (global shape, dtype)`` of every tensor in a DCP index (non-tensor entries are left out).

    Args:
        metadata: a checked index (``read_metadata``).

    Returns:
        The shapes and dtypes the checkpoint holds, by key.
    """
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
