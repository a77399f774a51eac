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

The sharded part, and the safe reading of DCP's pickled index, is ``training.sharded_checkpoint``; its names are
re-exported here, so ``training.checkpoint`` is the one module a caller needs.

Writes go to a hidden folder that is renamed into place; a replaced or pruned folder is first renamed
aside, so every instant of a save leaves the previous or the new checkpoint whole, and the next save or
load finishes or undoes what an interrupted one left. The scheme is the one model checkpoints use
(``models.checkpoints.atomic``: ``replace_folder``, ``remove_folder``, ``recover``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

import torch

from models.checkpoints import atomic
from models.checkpoints.atomic import fsync
from models.checkpoints.files import read_json
from models.checkpoints.paths import confined

from .sharded_checkpoint import (
    load_sharded,
    optimizer_skeleton,
    read_metadata,
    sharded_state,
    tensor_shapes,
    trainable_names,
    write_sharded,
)

__all__ = [
    "CHECKPOINT_PREFIX", "FORMAT_VERSION", "MANIFEST_NAME", "SHARDED_DIR", "STATE_NAME", "list_checkpoints",
    "load_sharded", "load_torch", "optimizer_skeleton", "publish", "read_metadata", "recover", "remove", "rng_name",
    "save_torch", "sharded_state", "staging_folder", "tensor_shapes", "trainable_names", "verify_manifest",
    "write_manifest", "write_sharded",
]

FORMAT_VERSION = 2
CHECKPOINT_PREFIX = "step-"
STATE_NAME = "trainer_state.pt"
MANIFEST_NAME = "manifest.json"
SHARDED_DIR = "sharded"
# What interrupted saves of earlier transformer-zoo versions left: .step-N.tmp, .step-N.replaced, .step-N.<id>.deleting
_OLD_LEFTOVER = re.compile(rf"\.(?P<name>{CHECKPOINT_PREFIX}\d+)(?P<kind>\.tmp|\.replaced|\.[0-9a-f]{{8}}\.deleting)")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def rng_name(rank: int) -> str:
    """The file name of process ``rank``'s random state inside a checkpoint folder.

    Args:
        rank: the process's global rank.

    Returns:
        ``rng-rank<rank>.pt``.
    """
    return f"rng-rank{rank}.pt"


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

    Args:
        folder: the checkpoint folder.

    Returns:
        The problems, one message each (a missing or damaged manifest is one problem): empty when every file is
        listed, present, of its recorded size and SHA-256.

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
    """``torch.save`` then flush to disk (the bytes are serialised in memory first, so a failure to pickle leaves no
    half-written file).

    Args:
        obj: plain data and tensors (what ``torch.load(weights_only=True)`` reads back).
        path: the file to write.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
        f.flush()
        os.fsync(f.fileno())


def load_torch(path: Path, what: str) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU: a missing or damaged file becomes a ``ValueError`` naming it,
    an I/O failure stays an ``OSError`` (naming it).

    Args:
        path: the file.
        what: what the file holds (for messages: ``"trainer state"``).

    Returns:
        The loaded object (plain data and tensors only: ``weights_only`` builds nothing else).

    Raises:
        ValueError: the file is missing or does not load (damaged, or holding more than plain data).
        OSError: the file could not be read.
    """
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
    every process (each writes its shards there); the main process creates it after ``recover``.

    Args:
        root: the checkpoint directory.
        name: the checkpoint folder's name (``step-NNNNNNNN``).

    Returns:
        The staging folder's path (not created here).
    """
    return atomic.shared_staging_folder(root / name)


def publish(staging: Path, final: Path) -> None:
    """Make the finished ``staging`` folder the checkpoint ``final``, replacing an existing one as a whole:
    ``final`` (or the old one renamed aside, which ``recover`` puts back) is always whole.

    Args:
        staging: the finished folder from ``staging_folder``.
        final: the checkpoint folder it becomes.
    """
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
