"""Folders written atomically, even against SIGKILL: model checkpoints, adapters and trainer checkpoints.

A checkpoint folder is staged in a hidden sibling (``staging_folder``) and then made the real one: file by file for
a model or adapter folder (``publish``), as a whole for a trainer checkpoint with sub-folders (``replace_folder``).
A folder is deleted by renaming it aside first (``remove_folder``). Whatever an interrupted save or removal left is
finished or discarded by ``recover`` (``recover_all`` for every folder of a parent), and loads read a folder under
a lock (``reading``), so a reader sees one complete checkpoint. The scheme is described below the imports.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import blocks

from ..convert.export import FOLDER_WRITER_KIND
from .file_staging import staging_file
from .files import CONFIG_NAME
from .folder_locks import flock, folder_lock, fsync, new_locked_folder

__all__ = ["SHARED_ID", "fsync", "publish", "reading", "recover", "recover_all", "remove_folder", "replace_folder",
           "shared_staging_folder", "staging_folder", "write_file", "write_folder"]

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
# A whole folder with sub-folders (a trainer checkpoint: its DCP shards) is replaced as a whole instead
# (``replace_folder``): under its exclusive lock the old folder is renamed aside to ``.<name>.<id>.replaced``, the
# staging folder renamed to the target (the commit point) and the old one removed. Recovery puts a dead writer's
# ``.replaced`` back when the target is missing (the kill came between the two renames) and deletes it otherwise.
# ``remove_folder`` renames a folder to ``.<name>.<id>.deleting`` before deleting it, so a half-deleted folder
# never looks like a checkpoint; recovery deletes what is left.
#
# Why not swap whole folders for model checkpoints: the target may be a mount point or the working directory, it
# may hold other files, and between the two renames it would not exist. Why not symlinks to versioned sub-folders:
# a checkpoint folder must stay plain files that transformers, huggingface_hub and ``cp`` read as they are.


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}\.(?P<kind>saving|commit|replaced|deleting|backup)")
#: the id of a staging folder that several processes write into (``shared_staging_folder``).
SHARED_ID = "0" * 12

step_hook: Callable[[str], None] | None = None
"""Tests only: called with a label after every durable step of a save (fsync, rename, replace, rmdir), so a test
can kill the process at each of them."""


def _step(label: str) -> None:
    if step_hook is not None:
        step_hook(label)


@blocks.register(FOLDER_WRITER_KIND, "atomic")  # found there by writers below this package (save_transformers)
def write_folder(target: Path, write: Callable[[Path], None], *, what: str = "a checkpoint") -> None:
    """Write the folder ``target`` atomically: ``write(staging)`` fills a ``staging_folder`` with plain files, which
    ``publish`` then makes the folder's files (other files already in ``target`` are kept).

    Args:
        target: the folder (created with its parents if needed).
        write: writes the files into the folder it is given.
        what: names what is saved in messages (``"an adapter"``).

    Raises:
        NotADirectoryError: ``target`` exists and is not a folder (checked before anything is written).
        OSError: writing or flushing failed (a full disk, ...): the message names ``target``, the file and whether
            ``target`` is unchanged (the failure came before the commit point: nearly always) or the new files are
            committed and the next save or load of the folder finishes moving them in.
    """
    target = Path(target).expanduser().resolve()  # leftovers are found beside the real folder
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"cannot save {what} to {target}: it exists and is not a folder")
    with staging_folder(target) as staging:
        try:
            write(staging)
            publish(staging, target)
        except OSError as e:
            if e.errno is None:
                raise  # one of ours, already saying what is wrong
            state = (
                f"{target} is unchanged" if staging.exists() else
                f"the new files are committed, and the next save or load of {target} finishes moving them in"
            )
            raise OSError(e.errno, f"saving {what} to {target} failed ({e}); {state}", e.filename) from e


def write_file(target: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write one file atomically, even against SIGKILL: ``data`` goes to a hidden staging file beside ``target``
    (``file_staging.staging_file``), which is flushed, renamed over ``target`` and the folder flushed. A reader sees
    the old file or the new one; a killed save's staging file is removed by the next save of ``target``.

    Args:
        target: the file (its folder is created if needed).
        data: the content; a ``str`` is written as UTF-8.

    Returns:
        ``target`` as a ``Path``.

    Raises:
        IsADirectoryError: ``target`` is a folder (nothing is written).
    """
    target = Path(target)
    if target.is_dir():
        raise IsADirectoryError(f"cannot write the file {target}: it is a folder")
    with staging_file(target) as staging:
        staging.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        fsync(staging)
        _step(f"fsync {target.name}")
        os.replace(staging, target)
        _step(f"replace {target.name}")
        fsync(staging.parent)
        _step("fsync parent folder")
    return target


@contextmanager
def staging_folder(target: Path) -> Iterator[Path]:
    """A fresh hidden folder beside ``target`` (same filesystem, so moves are renames), locked by this process.

    Leftovers of earlier interrupted saves of ``target`` are recovered first. The folder is removed on exit
    unless ``publish`` moved it into place.

    Args:
        target: the checkpoint folder that will be written (need not exist; its parents are created).

    Yields:
        The staging folder's path.
    """
    target = Path(target).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    staging, fd = new_locked_folder(target.parent, f".{target.name}.", ".saving")
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
    if _first_save(staging, target):
        return
    commit = staging.with_name(staging.name.removesuffix(".saving") + ".commit")
    with folder_lock(target, exclusive=True):
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
            with folder_lock(target, exclusive=True):
                for commit in _leftovers(target, ("commit",)):  # listed again: a live writer may have finished
                    _switch(commit, target)
        except OSError as e:
            raise OSError(
                e.errno, f"{target} holds a save that was interrupted after its commit point, and finishing it "
                f"failed ({e}); until it is finished the folder mixes two checkpoints"
            ) from e
    for aside in _leftovers(target, ("replaced",)):
        _remove_if_abandoned(aside, restore_to=target)
    for folder in _leftovers(target, ("saving", "deleting", "backup")):
        _remove_if_abandoned(folder)


def recover_all(parent: Path, prefix: str = "") -> None:
    """``recover`` every folder of ``parent`` whose name starts with ``prefix`` and that interrupted saves or
    removals left something beside (whether or not the folder itself still exists).

    Args:
        parent: the folder holding checkpoint folders (a trainer's ``checkpoint_dir``); nothing is done when it
            cannot be listed.
        prefix: the start of the names to recover (``"step-"``); empty for every one.
    """
    try:
        names = {m["name"] for e in os.scandir(parent) if (m := _LEFTOVER.fullmatch(e.name))}
    except OSError:
        return
    for name in sorted(n for n in names if n.startswith(prefix)):
        recover(Path(parent) / name)


@contextmanager
def reading(folder: Path | None) -> Iterator[None]:
    """Hold a local checkpoint folder still while it is read: a shared lock, after finishing any dead writer's
    committed save, so the reader sees one complete checkpoint. Nothing to do for ``None`` (a Hub checkpoint: the
    cache keeps each commit apart).

    Args:
        folder: the local checkpoint folder, or None.

    Yields:
        Nothing: the folder is complete and held still while the block runs.

    Raises:
        OSError: a committed save could not be completed (e.g. a read-only folder).
    """
    if folder is None:
        yield
        return
    folder = folder.resolve()
    while True:
        with folder_lock(folder, exclusive=False):
            # With the shared lock held no live writer is mid-switch (it holds the exclusive lock), so a
            # .commit seen now belongs to a dead one.
            if not _leftovers(folder, ("commit",)):
                yield
                return
        recover(folder)


def replace_folder(staging: Path, target: Path) -> None:
    """Make the folder ``staging`` (sub-folders included) the folder ``target``, replacing any old one as a whole,
    atomically even against SIGKILL: every instant leaves the old or the new folder complete (see the section
    comment above).

    Args:
        staging: the finished folder, beside ``target`` (``staging_folder`` or ``shared_staging_folder``).
        target: the folder to replace (need not exist).

    Raises:
        NotADirectoryError: ``target`` exists and is not a folder.
    """
    target = Path(target).expanduser().resolve()
    for folder, _, names in os.walk(staging):
        for name in names:
            fsync(Path(folder) / name)
        fsync(Path(folder))
    _step("fsync staging folder")
    if _first_save(staging, target):
        return
    aside = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.replaced")
    # The lock goes with the old folder when it is renamed: recover() leaves the aside folder alone while it is held.
    with folder_lock(target, exclusive=True):
        os.rename(target, aside)
        _step("rename target aside")
        os.rename(staging, target)
        _step("rename staging folder to target")
        fsync(target.parent)
        _step("fsync parent folder")
        shutil.rmtree(aside, ignore_errors=True)
        _step("remove replaced folder")


def remove_folder(folder: Path) -> None:
    """Delete ``folder``: renamed to a hidden ``.deleting`` sibling first (one atomic step), so a half-deleted
    folder is never seen under its name; ``recover`` deletes what a removal cut short left.

    Args:
        folder: the folder to delete (it must exist).
    """
    folder = Path(folder).expanduser().resolve()
    doomed = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:12]}.deleting")
    os.rename(folder, doomed)
    _step(f"rename {folder.name} to be deleted")
    fsync(folder.parent)
    shutil.rmtree(doomed, ignore_errors=True)
    _step(f"remove {doomed.name}")


def shared_staging_folder(target: Path) -> Path:
    """The staging folder of ``target`` for a save that several processes write into (a trainer checkpoint: each
    rank writes its shards): the same path in every process, created by one of them, not locked. ``recover``
    treats it as any abandoned staging folder, so recover only when no such save is running.

    Args:
        target: the folder the save will become.

    Returns:
        ``.<name>.000000000000.saving`` beside ``target`` (not created here).
    """
    return Path(target).with_name(f".{Path(target).name}.{SHARED_ID}.saving")


def _first_save(staging: Path, target: Path) -> bool:
    """Rename ``staging`` to a ``target`` that does not exist yet (one atomic step); ``False`` when it exists, and
    the caller replaces it.

    Raises:
        NotADirectoryError: ``target`` exists and is not a folder.
    """
    if not target.exists():
        try:
            os.rename(staging, target)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # A concurrent first save got there first: replace it, as any later save does.
        else:
            _step("rename staging folder to target")
            fsync(target.parent)
            _step("fsync parent folder")
            return True
    if not target.is_dir():
        raise NotADirectoryError(f"cannot save a checkpoint to {target}: it exists and is not a folder")
    return False


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


def _remove_if_abandoned(folder: Path, restore_to: Path | None = None) -> None:
    """Delete a leftover folder that no live process holds locked, or rename it back to ``restore_to`` when that
    folder is missing (an old folder set aside by a replacement that never arrived)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # gone already, or not ours to open
    try:
        # Only a folder nobody holds locked is abandoned; without flock we cannot tell, so it stays.
        if flock(fd, exclusive=True, blocking=False):
            if restore_to is not None and not restore_to.exists():
                os.rename(folder, restore_to)
                fsync(restore_to.parent)
                _step(f"restore {folder.name}")
            else:
                shutil.rmtree(folder, ignore_errors=True)
                _step(f"remove {folder.name}")
    finally:
        os.close(fd)


