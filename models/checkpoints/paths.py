"""The one path guard: a name read from a file or a server must stay inside the folder it names a file of.

Checkpoint shard indexes, trainer manifests, DCP storage metadata, GGUF split names and Hub metadata (ETags,
commit ids) all carry names that the loaders join to a folder. Every such join goes through ``confined`` here, so a
name like ``../../etc/hostname``, an absolute path or a symlink that leads out of the folder is refused with a
``ValueError`` before anything is read or written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath

#: What a Hub ETag may be once its quotes are stripped: a git blob sha1 or an LFS sha256, lowercase hex.
_ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def confined(folder: str | os.PathLike[str], name: object, what: str, *, file_may_link: bool = False) -> Path:
    """``folder / name``, checked to lie inside ``folder`` (after resolving ``..`` and symlinks).

    Args:
        folder: the folder the name is relative to.
        name: the name as read from the file or server (must be a non-empty relative path string).
        what: what the name is, for the message (e.g. ``"the shard index entry for 'lm_head.weight'"``).
        file_may_link: for a file that is only read: the file itself may be a symlink that the folder holds and
            that leads elsewhere (a Hugging Face cache snapshot links every file to ``../../blobs/<etag>``), as
            every reader of such folders follows it. The name still cannot step out, through ``..`` or through a
            linked sub-folder. Writers keep the default, which resolves the whole path.

    Returns:
        The joined path (not resolved: the caller opens it as it would have).

    Raises:
        ValueError: ``name`` is not a string, is empty, absolute, holds a NUL byte or a drive, or leads out of
            ``folder``; the message quotes it and says what was expected.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"{what} must be a non-empty relative file name, got {name!r}")
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive:
        raise ValueError(f"{what} must be a relative file name inside {folder}, got the absolute path {name!r}")
    base = Path(folder).resolve()
    path = Path(folder) / name
    if file_may_link:
        if PurePosixPath(name.replace("\\", "/")).name in ("", ".", ".."):
            raise ValueError(f"{what} names {name!r}, which is not a file name; expected a file inside {folder}")
        resolved = path.parent.resolve()
    else:
        resolved = path.resolve()
    if resolved != base and base not in resolved.parents:
        raise ValueError(f"{what} names {name!r}, which leads outside {folder}; expected a file inside that folder")
    return path


def check_etag(etag: object, what: str) -> str:
    """A Hub file's ETag (quotes and a weak ``W/`` prefix stripped), checked to be a sha1 or sha256 in hex.

    ``huggingface_hub`` names cache files after the ETag, so one such as ``../../x`` would be written outside the
    cache; checking it before the download is the guard.

    Args:
        etag: the value the server sent.
        what: what the value is, for the message (the response and its header).

    Returns:
        The ETag, stripped.

    Raises:
        ValueError: anything else, quoted.
    """
    text = etag.removeprefix("W/").strip('"') if isinstance(etag, str) else etag
    if not isinstance(text, str) or not _ETAG.fullmatch(text):
        raise ValueError(f"{what}: the server sent the ETag {etag!r}; expected 40 or 64 lowercase hex digits")
    return text


def check_commit(commit: object, what: str) -> str:
    """A Hub commit id, checked to be 40 lowercase hex digits (it names a cache folder).

    Args:
        commit: the value the server sent.
        what: what the value is, for the message (the response and its header).

    Returns:
        The commit id.

    Raises:
        ValueError: anything else, quoted.
    """
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise ValueError(f"{what}: the server sent the commit id {commit!r}; expected 40 lowercase hex digits")
    return commit
