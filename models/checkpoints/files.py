"""Checkpoint files on disk and on the Hub: find them, read them safely, write a folder atomically.

A checkpoint folder holds ``config.json``, ``model.safetensors`` (or sharded ``model-*.safetensors`` with
``model.safetensors.index.json``), optionally ``tokenizer.json`` and a ``README.md`` model card. The only
pickle ever read is ``pytorch_model.bin``, through ``torch.load(weights_only=True)``, which refuses anything
that is not plain tensors. Hub files are fetched and cached by ``huggingface_hub``, with transient server
errors retried (``hub_download``). Saves are atomic even against SIGKILL (``staging_folder``, ``publish``,
``recover``; the scheme is described above ``staging_folder``), and loads read a folder under a lock
(``reading``), so a reader sees one complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

try:
    import fcntl
except ImportError:  # Windows: saves stay atomic, but leftovers of killed saves are never judged abandoned
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

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
    """
    save_file(state, str(path), metadata={"format": "pt"})


def write_json(obj: dict[str, Any], path: Path) -> None:
    """Write ``obj`` as indented JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------- atomic saves
# How a save survives being killed at any instant (SIGKILL included):
#
#   stage   every file is written into a fresh hidden sibling ``.<name>.<id>.saving`` that its writer holds
#           locked (flock), then each file and the folder are fsynced. Killed here: the target is untouched.
#   commit  under the target's exclusive lock the staging folder is renamed ``.<name>.<id>.commit`` and the
#           parent fsynced. This rename is the commit point: from here on the new checkpoint is the one that
#           every later reader sees, and whoever touches the target next finishes the switch.
#   switch  each file moves into the target with one os.replace (config.json last); the target is fsynced and
#           the empty ``.commit`` folder removed.
#
# A first save renames the staging folder to the target instead (one atomic step). Every later save or load of
# the target first *recovers*: it rolls a dead writer's ``.commit`` forward (the switch again: idempotent) and
# deletes a dead writer's ``.saving`` (and the ``.backup`` folders of earlier transformer-zoo versions). "Dead"
# is decided by flock, which the kernel releases when a process dies, so a save in progress in another process
# is never touched. Loads read under a shared lock on the folder, so they never see a switch half done.
# (A tool that reads the folder directly, not through the zoo, may see a mix of files after a kill past the commit
# point and before the next save or load: the roll-forward happens when the zoo next touches the folder.)
#
# Why not swap whole folders: the target may be a mount point or the working directory, it may hold other
# files, and between the two renames it would not exist. Why not symlinks to versioned sub-folders: a
# checkpoint folder must stay plain files that transformers, huggingface_hub and ``cp`` read as they are.

_LEFTOVER = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}\.(?P<kind>saving|commit|backup)")

_step_hook: Callable[[str], None] | None = None
"""Tests only: called with a label after every durable step of a save (fsync, rename, replace, rmdir), so a test
can kill the process at each of them."""


def _step(label: str) -> None:
    if _step_hook is not None:
        _step_hook(label)


@contextmanager
def staging_folder(target: Path) -> Iterator[Path]:
    """A fresh hidden folder beside ``target`` (same filesystem, so moves are renames), locked by this process.

    Leftovers of earlier interrupted saves of ``target`` are recovered first. The folder is removed on exit
    unless ``publish`` moved it into place.

    Args:
        target: the checkpoint folder that will be written (need not exist; its parents are created).
    """
    target = Path(target).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    staging, fd = _new_locked_folder(target.parent, f".{target.name}.", ".saving")
    try:
        yield staging
    finally:
        try:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when published
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock: a dead save looks exactly like this to recover()


def publish(staging: Path, target: Path) -> None:
    """Make the files of ``staging`` the checkpoint in ``target``, atomically even against SIGKILL.

    A new ``target`` is one rename of the whole folder. An existing one gets the commit-then-switch of the
    section comment above: a reader (``from_pretrained``) sees either every old file or every new one. Other
    files already in ``target`` are kept.

    Args:
        staging: a folder from ``staging_folder(target)`` holding plain files only.
        target: the checkpoint folder.

    Raises:
        NotADirectoryError: ``target`` exists and is not a folder.
        ValueError: ``staging`` holds something that is not a plain file.
    """
    target = Path(target).expanduser().resolve()
    files = sorted(staging.iterdir())
    for path in files:
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"{path} is not a plain file; a checkpoint folder is published file by file")
    for path in files:
        fsync(path)
        _step(f"fsync {path.name}")
    fsync(staging)
    _step("fsync staging folder")
    if not target.exists():
        try:
            os.rename(staging, target)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # A concurrent first save got there first: replace its files, as any later save does.
        else:
            _step("rename staging folder to target")
            fsync(target.parent)
            _step("fsync parent folder")
            return
    if not target.is_dir():
        raise NotADirectoryError(f"cannot save a checkpoint to {target}: it exists and is not a folder")
    commit = staging.with_name(staging.name.removesuffix(".saving") + ".commit")
    with _folder_lock(target, exclusive=True):
        for dead in _leftovers(target, ("commit",)):
            _switch(dead, target)  # finish a dead writer's save before committing over it
        os.rename(staging, commit)
        _step("commit")
        fsync(target.parent)
        _step("fsync parent folder")
        try:
            _switch(commit, target)
        except BaseException:
            # Past the commit point the new checkpoint is the one to complete. An interrupt between two renames
            # is finished now; anything that fails again is finished by the next save or load of the folder.
            with suppress(Exception):
                _switch(commit, target)
            raise


def recover(target: Path) -> None:
    """Finish or discard what interrupted saves of ``target`` left beside it.

    A ``.commit`` folder whose writer died is rolled forward into ``target``; ``.saving`` folders whose writer
    died, and ``.backup`` folders of earlier transformer-zoo versions, are deleted. Folders of a save still
    running in another process are left alone.

    Args:
        target: a checkpoint folder (it need not exist).

    Raises:
        OSError: a committed save could not be completed (e.g. a read-only folder).
    """
    target = Path(target).expanduser().resolve()
    if _leftovers(target, ("commit",)):
        try:
            if not target.exists():  # the target was deleted by hand after the commit: the commit is the checkpoint
                for commit in _leftovers(target, ("commit",))[-1:]:
                    os.rename(commit, target)
            with _folder_lock(target, exclusive=True):
                for commit in _leftovers(target, ("commit",)):  # listed again: a live writer may have finished
                    _switch(commit, target)
        except OSError as e:
            raise OSError(
                e.errno, f"{target} holds a save that was interrupted after its commit point, and finishing it "
                f"failed ({e}); until it is finished the folder mixes two checkpoints"
            ) from e
    for folder in _leftovers(target, ("saving", "backup")):
        _remove_if_abandoned(folder)


@contextmanager
def reading(location: Location) -> Iterator[None]:
    """Hold a local checkpoint folder still while it is read: a shared lock, after finishing any dead writer's
    committed save, so the reader sees one complete checkpoint. Nothing to do for a Hub checkpoint (the cache
    keeps each commit apart).

    Raises:
        OSError: a committed save could not be completed (e.g. a read-only folder).
    """
    if location.folder is None:
        yield
        return
    folder = location.folder.resolve()
    while True:
        with _folder_lock(folder, exclusive=False):
            # With the shared lock held no live writer is mid-switch (it holds the exclusive lock), so a
            # .commit seen now belongs to a dead one.
            if not _leftovers(folder, ("commit",)):
                yield
                return
        recover(folder)


def _switch(commit: Path, target: Path) -> None:
    """Move every file of a committed folder into ``target`` (config.json last), then remove the folder.

    Idempotent: files already moved are no longer in ``commit``, so a switch cut short can be run again.
    """
    try:
        names = os.listdir(commit)
    except FileNotFoundError:
        return  # finished by another process
    for name in sorted(names, key=lambda n: (n == CONFIG_NAME, n)):
        os.replace(commit / name, target / name)
        _step(f"replace {name}")
    fsync(target)
    _step("fsync target folder")
    os.rmdir(commit)
    _step("remove commit folder")
    fsync(target.parent)


def _leftovers(target: Path, kinds: tuple[str, ...]) -> list[Path]:
    """Hidden folders beside ``target`` left by saves of it, of the given kinds, oldest first."""
    prefix = f".{target.name}."
    try:
        entries = [e for e in os.scandir(target.parent) if e.name.startswith(prefix)]
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry.name)
        if match and match["name"] == target.name and match["kind"] in kinds and entry.is_dir(follow_symlinks=False):
            with suppress(OSError):
                found.append((entry.stat(follow_symlinks=False).st_mtime_ns, Path(entry.path)))
    return [path for _, path in sorted(found)]


def _remove_if_abandoned(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # gone already, or not ours to open
    try:
        # Only a folder nobody holds locked is abandoned; without flock we cannot tell, so it stays.
        if _flock(fd, exclusive=True, blocking=False):
            shutil.rmtree(folder, ignore_errors=True)
            _step(f"remove {folder.name}")
    finally:
        os.close(fd)


def _new_locked_folder(parent: Path, prefix: str, suffix: str) -> tuple[Path, int | None]:
    """Create a uniquely named folder and lock it; returns the path and the open descriptor holding the lock
    (``None`` on platforms without flock)."""
    while True:
        path = parent / f"{prefix}{uuid.uuid4().hex[:12]}{suffix}"
        path.mkdir()
        if fcntl is None:
            return path, None
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # another process's recover() took it for a dead save's leftover before we locked it
        _flock(fd, exclusive=True)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return path, fd
        except FileNotFoundError:
            pass  # removed between our mkdir and our lock, as above
        os.close(fd)


@contextmanager
def _folder_lock(folder: Path, *, exclusive: bool) -> Iterator[None]:
    if fcntl is None:  # folders cannot even be opened on Windows
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        _flock(fd, exclusive=exclusive)
        yield
    finally:
        os.close(fd)  # releases the lock


def _flock(fd: int, *, exclusive: bool, blocking: bool = True) -> bool:
    """Lock an open file or folder; ``False`` when another process holds it (non-blocking), or when this
    platform or filesystem has no ``flock`` (then nothing is locked and nothing may be deleted as abandoned)."""
    if fcntl is None:
        return False
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, mode)
    except BlockingIOError:
        return False
    except OSError as e:  # e.g. ENOLCK on a network filesystem without locks
        logger.debug("cannot lock a checkpoint folder (%s): going on without the lock", e)
        return False
    return True


def fsync(path: Path) -> None:
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


def load_tokenizer(path: Path) -> Any:
    """Load a checkpoint's ``tokenizer.json`` as a ``tokenization.Tokenizer`` (special-token roles come from a
    ``tokenizer_config.json`` beside it, when present).

    Raises:
        ValueError: the file is not a valid tokenizer (the path is named).
    """
    from tokenization import Tokenizer  # imported here: models must not need tokenization to import

    return Tokenizer.from_file(path)


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
        """Download ``filename`` of the located commit into the ``huggingface_hub`` cache (Hub only).

        Transient server errors are retried (see ``hub_download``).
        """
        assert self.repo_id is not None and self.commit is not None
        return hub_download(self.repo_id, filename, revision=self.commit, token=self.token, endpoint=self.endpoint)

    def fetch_optional(self, filename: str) -> Path | None:
        """``fetch``, or ``None`` when the file is not in the commit (or, offline, not in the cache)."""
        try:
            return self.fetch(filename)
        except EntryNotFoundError as e:
            # Absent means "the Hub says there is no such file", or an offline cache miss; a server or network
            # failure is raised, never mistaken for an absent file (that would load a model without its tokenizer).
            offline = isinstance(e, LocalEntryNotFoundError) and (
                e.__cause__ is None or isinstance(e.__cause__, OfflineModeIsEnabled)
            )
            if isinstance(e, RemoteEntryNotFoundError) or offline:
                return None
            raise


# ---------------------------------------------------------------------------------------------- Hub downloads
# hf_hub_download already retries the metadata request (HEAD) on 5xx and network errors with http_backoff, and
# resumes a download cut by a network error, but it does not retry the download request (GET) on a 5xx, and a
# metadata request that keeps failing surfaces as LocalEntryNotFoundError ("... cannot find the requested files in
# the local cache"), which hides the status. hub_download adds the missing retry, with http_backoff's schedule
# (1, 2, 4, 8, 8 s; attributes below, so tests can shorten it), around the whole cached download, and reports a
# persistent failure as the server's own error.
HUB_RETRIES = 5
HUB_RETRY_WAIT_S = 1.0
HUB_RETRY_MAX_WAIT_S = 8.0
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)  # huggingface_hub's http_backoff default


def hub_download(
    repo_id: str, filename: str, *, revision: str, token: str | bool | None = None, endpoint: str | None = None
) -> Path:
    """``hf_hub_download`` into the cache, retrying transient server errors, reporting the real failure.

    Args:
        repo_id, filename, revision, token, endpoint: as for ``huggingface_hub.hf_hub_download``.

    Returns:
        The cached file's path.

    Raises:
        huggingface_hub.errors.HfHubHTTPError: the Hub kept answering an error status (the status is in the
            message and in ``.response.status_code``), or answered a non-transient one.
        huggingface_hub.errors.RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError: as
            ``hf_hub_download``.
        huggingface_hub.errors.LocalEntryNotFoundError: offline (or unreachable) and not in the cache.
    """
    wait = HUB_RETRY_WAIT_S
    for attempt in range(HUB_RETRIES + 1):
        try:
            return Path(hf_hub_download(
                repo_id, filename, revision=revision, token=token, endpoint=endpoint,
                library_name=LIBRARY_NAME, library_version=library_version(),
            ))
        except LocalEntryNotFoundError as e:
            # The metadata request failed even after huggingface_hub's own retries: say why, when the Hub said.
            if isinstance(e.__cause__, HfHubHTTPError) and e.__cause__.response is not None:
                cause = e.__cause__
                _append_to_message(cause, f"\n[transformer-zoo: could not download {filename!r} of {repo_id!r} at "
                                          f"revision {revision!r}; huggingface_hub retried with backoff]")
                raise cause from None
            raise
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status not in TRANSIENT_STATUS or isinstance(e, EntryNotFoundError):
                raise
            if attempt == HUB_RETRIES:
                _append_to_message(e, f"\n[transformer-zoo: downloading {filename!r} of {repo_id!r} at revision "
                                      f"{revision!r} failed {attempt + 1} times with a server error]")
                raise
            logger.warning(
                "the Hub answered HTTP %s while downloading %r of %r; retrying in %.1f s [%d/%d]",
                status, filename, repo_id, wait, attempt + 1, HUB_RETRIES,
            )
            time.sleep(wait)
            wait = min(HUB_RETRY_MAX_WAIT_S, wait * 2)
    raise AssertionError("unreachable")


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
    text = os.fspath(path_or_repo_id)
    path_like = isinstance(path_or_repo_id, os.PathLike) or text.startswith((".", "~", "/")) or text.count("/") > 1
    if path.exists() or path_like:
        recover(path)  # finish or discard what interrupted saves left, before looking at the folder
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} only applies to Hub repos, but {path} is a local folder")
        if not path.is_dir():
            raise ValueError(f"{path} is a file; expected a checkpoint folder (holding {CONFIG_NAME} and weights)")
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; it holds {sorted(p.name for p in path.iterdir())}")
        return Location(source=str(path), config=path / CONFIG_NAME, folder=path)
    if path_like:
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
