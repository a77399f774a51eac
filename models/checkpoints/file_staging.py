"""A single file written atomically (a GGUF export): staged under a hidden name beside it, renamed over it when
complete, and the staging files of killed saves removed by the next save of the same file.

A staging file ``.<name>.<id>.saving`` is held locked (flock) by its writer while it exists; the kernel releases the
lock when the writer dies, even by SIGKILL, so a staging file nobody holds locked is an abandoned one, and a save in
progress in another process is never touched (as for checkpoint folders, ``models.checkpoints.atomic``).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: saves stay atomic, but staging files of killed saves are never judged abandoned
    fcntl = None  # type: ignore[assignment]

_STAGING = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}\.saving")


@contextmanager
def staging_file(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh hidden file beside ``target``, locked by this process; the caller writes it and renames it over
    ``target`` (``os.replace``) when complete.

    Staging files of earlier saves of ``target`` that no live process holds are removed first. The file is removed
    on exit unless it was moved into place.

    Args:
        target: the file that will be written (its folder is created if needed).

    Yields:
        The staging file's path (created empty, locked by this process).
    """
    target = Path(target).expanduser().absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target)
    while True:
        path = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.saving"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        _lock(fd, blocking=True)
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass  # another save's cleanup took it for an abandoned one before we locked it
        os.close(fd)
    try:
        yield path
    finally:
        try:
            with suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):  # still the staging file: not moved into place
                    path.unlink()
        finally:
            os.close(fd)  # releases the lock: a killed save looks exactly like this to remove_abandoned


def remove_abandoned(target: str | os.PathLike[str]) -> list[str]:
    """Remove the staging files of earlier saves of the file ``target`` that no live process holds locked.

    Args:
        target: the file whose staging files are looked for (beside it).

    Returns:
        The names removed. Without flock (or on a filesystem without locks) nothing can be judged abandoned, so
        nothing is removed.
    """
    target = Path(target).expanduser().absolute()
    removed: list[str] = []
    try:
        entries = [e for e in os.scandir(target.parent) if e.name.startswith(f".{target.name}.")]
    except OSError:
        return removed
    for entry in entries:
        match = _STAGING.fullmatch(entry.name)
        if match is None or match["name"] != target.name or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if _lock(fd, blocking=False):
                with suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
        finally:
            os.close(fd)
    return removed


def _lock(fd: int, *, blocking: bool) -> bool:
    """An exclusive flock; ``False`` when another process holds it, or where there is no flock."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:  # BlockingIOError: held by a live save; ENOLCK: a filesystem without locks
        return False
    return True
