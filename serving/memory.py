"""What a process holds in memory, and handing the heap it has freed back to the system.

Summing the resident sets (RSS) of several processes counts the pages they share (torch's libraries, a weights file
mapped by two of them) once per process; the proportional set (PSS) splits each shared page among its holders, so
the PSS of a server's processes adds up to what they hold together. The unique set (USS: private pages) is what
a process alone frees when it exits. Linux reports all three in ``/proc/PID/smaps_rollup``.

glibc's ``malloc`` keeps freed small and medium blocks in its arenas for reuse instead of returning them: after a
burst of requests (activations, logits, gathers) a process can hold hundreds of MiB it no longer uses.
``release_freed_memory`` returns them (``malloc_trim``); the engine process calls it when it goes idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

#: The fields of ``process_memory`` (bytes).
FIELDS = ("rss", "pss", "uss", "anonymous")


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """The resident, proportional and unique set sizes and the anonymous (not file-backed) resident bytes of a
    process.

    Args:
        pid: the process id (``"self"``: this process).

    Returns:
        ``{"rss", "pss", "uss", "anonymous"}`` in bytes; zeros where the system has no ``smaps_rollup``.
    """
    values = dict.fromkeys(("Rss", "Pss", "Private_Clean", "Private_Dirty", "Anonymous"), 0)
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return dict.fromkeys(FIELDS, 0)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].rstrip(":") in values:
            values[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"rss": values["Rss"], "pss": values["Pss"], "uss": values["Private_Clean"] + values["Private_Dirty"],
            "anonymous": values["Anonymous"]}


def descendants(pid: int) -> list[int]:
    """The ids of a process's children, their children, and so on (``/proc/PID/task/*/children``).

    Args:
        pid: the process id.

    Returns:
        The ids, parents before their children; processes that exit meanwhile are skipped.
    """
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def tree_memory(pid: int) -> dict[str, int]:
    """``process_memory`` summed over a process and all its descendants (PSS adds up; RSS counts shared pages
    once per process).

    Args:
        pid: the root process id.

    Returns:
        The summed fields in bytes, and ``"processes"``: how many were counted.
    """
    pids = [pid, *descendants(pid)]
    total = dict.fromkeys(FIELDS, 0)
    for each in pids:
        for key, value in process_memory(each).items():
            total[key] += value
    return {**total, "processes": len(pids)}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> bool:
    """Return the heap memory this process has freed to the system (glibc's ``malloc_trim(0)``).

    Returns:
        Whether anything could be released (False without glibc, e.g. on macOS or musl).
    """
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
