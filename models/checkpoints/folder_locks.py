"""Flushing and locking checkpoint folders: what ``models.checkpoints.atomic`` builds its crash-safe saves on.

``fsync`` flushes a file or folder to disk; ``flock`` and ``folder_lock`` take the advisory ``flock`` locks by which
a save in progress is told apart from a dead one (the kernel releases a dead process's locks); ``new_locked_folder``
creates a staging folder already locked by this process. Without ``fcntl`` (Windows) nothing is locked, and nothing
is ever judged abandoned.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: saves stay atomic, but leftovers of killed saves are never judged abandoned
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


def new_locked_folder(parent: Path, prefix: str, suffix: str) -> tuple[Path, int | None]:
    """Create a uniquely named folder and lock it (exclusively), so ``recover`` in another process leaves it alone.

    Args:
        parent: where the folder is created.
        prefix: the start of its name (``".<target>."``).
        suffix: the end of its name (``".saving"``).

    Returns:
        The folder's path and the open descriptor holding the lock (``None`` on platforms without flock): closing
        it releases the lock.
    """
    while True:
        path = parent / f"{prefix}{uuid.uuid4().hex[:12]}{suffix}"
        path.mkdir()
        if fcntl is None:
            return path, None
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # another process's recover() took it for a dead save's leftover before we locked it
        flock(fd, exclusive=True)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return path, fd
        except FileNotFoundError:
            pass  # removed between our mkdir and our lock, as above
        os.close(fd)


@contextmanager
def folder_lock(folder: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold a ``flock`` on ``folder`` for the ``with`` block (blocking until it is granted).

    Args:
        folder: an existing folder.
        exclusive: an exclusive (writer) lock; False for a shared (reader) one.

    Yields:
        Nothing: the lock is held while the block runs, and released on exit.
    """
    if fcntl is None:  # folders cannot even be opened on Windows
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        flock(fd, exclusive=exclusive)
        yield
    finally:
        os.close(fd)  # releases the lock


def flock(fd: int, *, exclusive: bool, blocking: bool = True) -> bool:
    """Lock an open file or folder; ``False`` when another process holds it (non-blocking), or when this
    platform or filesystem has no ``flock`` (then nothing is locked and nothing may be deleted as abandoned).

    Args:
        fd: an open descriptor of the file or folder.
        exclusive: an exclusive lock; False for a shared one.
        blocking: wait for the lock; False to return at once when another process holds it.

    Returns:
        Whether the lock is held now.
    """
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
    """Flush a file or folder to disk. For a folder this is best effort (some platforms cannot open or flush
    folders); for a file a failure is an error, since the data may not be on disk.

    Args:
        path: the file or folder (a folder is flushed so that the renames and new names inside it are durable).

    Raises:
        OSError: a file could not be flushed (e.g. ``EIO``, ``ENOSPC`` from a delayed write); the path is named.
            Filesystems that cannot flush at all (``EINVAL``, ``ENOTSUP``) are not an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if os.path.isdir(path):
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP) and not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(e.errno, f"flushing to disk failed ({e.strerror})", str(path)) from e
    finally:
        os.close(fd)
