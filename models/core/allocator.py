"""glibc's malloc settings for the process the zoo runs in: freed tensor memory is kept for the next step.

PyTorch's CPU tensors come from ``malloc``. By default glibc hands a large block back to the kernel when it is
freed: blocks above ``M_MMAP_THRESHOLD`` are ``mmap``-ed and ``munmap``-ed, and the top of the heap is trimmed
above ``M_TRIM_THRESHOLD`` (both start at 128 KiB and adapt only partly). A decoding or engine step allocates
and frees the same buffers every step (a BLAS packing buffer, a gathered key block, the logits), so each step
faults its buffers back in, one zeroed 4 KiB page at a time. Measured on 2 CPU cores, fp32: ``F.linear`` of 8
rows by a 3072 × 1024 weight took 15 ms with the defaults and 1.0 ms with the settings below (the packing
buffer's page faults were the whole difference); the engine's demo benchmark ran 5–20% faster.

``keep_freed_memory`` raises both thresholds, as PyTorch's CPU tuning guide gets by preloading jemalloc or
tcmalloc: blocks up to ``MMAP_THRESHOLD`` come from the heap and freed memory stays mapped up to
``TRIM_THRESHOLD``, so the resident size of a process stays at its peak instead of shrinking between steps.
``import models`` applies it once; set ``ZOO_KEEP_FREED_MEMORY=0`` before the import to keep glibc's defaults. It
does nothing off glibc (macOS, Windows, musl), and leaves the thresholds alone when the process was started with
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` set (the user's own choice).
"""

from __future__ import annotations

import ctypes
import os
import platform

#: glibc's ``mallopt`` parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Blocks up to this size come from the heap: glibc's largest allowed value on 64-bit (``HEAP_MAX_SIZE / 2``).
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the heap's top kept mapped, not returned to the kernel.
TRIM_THRESHOLD = 1024 * 1024 * 1024
#: The environment variable that turns the tuning off (``0``, ``false``, ``no``, ``off``).
ENV = "ZOO_KEEP_FREED_MEMORY"


def keep_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Raise glibc's mmap and trim thresholds (module docstring).

    Args:
        environ: the environment to read ``ZOO_KEEP_FREED_MEMORY`` and glibc's ``MALLOC_*`` variables from (default
            ``os.environ``).

    Returns:
        Whether both settings were applied.
    """
    environ = os.environ if environ is None else environ
    if environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in environ or "MALLOC_TRIM_THRESHOLD_" in environ:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
