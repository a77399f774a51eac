"""Give the memory a process has freed back to the system (glibc's ``malloc_trim``).

Building a large object from many small temporary ones (a 150k-token vocabulary: Python strings, tuples and a dict
on one side, ``tokenizers``' Rust strings on the other) leaves the freed small blocks in glibc's heap, counted in
the process's resident size until a later allocation reuses them, which the large allocations of tensors do not
(they are mapped apart). ``malloc_trim(0)`` returns every free page of the heap at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """This process's C library, where it is glibc (it has ``malloc_trim``); loaded once.

    Returns:
        The library, or None (another C library, e.g. on macOS or musl).
    """
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
    libc = glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
