"""What a process holds in memory, and handing the heap it has freed back to the system.

Summing the resident sets (RSS) of several processes counts the pages they share (torch's libraries, a weights file
mapped by two of them) once per process; the proportional set (PSS) splits each shared page among its holders, so
the PSS of a server's processes adds up to what they hold together. The unique set (USS: private pages) is what
a process alone frees when it exits. Linux reports all three in ``/proc/PID/smaps_rollup``.

glibc's ``malloc`` keeps freed small and medium blocks in its arenas for reuse instead of returning them: after a
burst of requests (activations, logits, gathers) a process can hold hundreds of MiB it no longer uses.
``release_freed_memory`` returns them (``malloc_trim``); the engine process calls it when it goes idle.

``torch.compile`` keeps, beside each compiled graph, what running it never reads again: dynamo's traced
``GraphModule`` (its FX graph, the fake example inputs, a stack trace per node: ~30 MiB for the engine's graphs of a
30-layer model), the serialized cache entries it recorded for ``torch.compiler.save_cache_artifacts`` and the graphs'
debug text. ``release_compile_state`` drops them; the engine's runner calls it after each step that compiled a graph.

``heap_breakdown`` splits the anonymous memory into Python's object arenas (and the bytes their live objects take:
an arena stays resident while any object in it lives) and glibc's ``malloc`` bytes in use.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from tokenization.heap import glibc, release_freed_memory

#: The fields of ``process_memory`` (bytes).
FIELDS = ("rss", "pss", "uss", "anonymous")
#: What ``aot_module_simplified`` hangs on the function a compiled graph runs through "for convenience": bound
#: methods of dynamo's traced ``GraphModule``, which keep it (and its nodes' fake values and stack traces) alive.
TRACED_GRAPH_HANDLES = ("zero_grad", "named_parameters", "named_buffers")
#: Debug text of an inductor graph (``CompiledFxGraph``), only logged when the graph is compiled or loaded.
GRAPH_DEBUG_TEXT = ("runnable_graph_str", "inductor_post_grad_graph_str")


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




class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


#: The lines of ``sys._debugmallocstats`` that ``heap_breakdown`` reads, and the keys it gives them.
PYMALLOC_STATS = {"# arenas allocated current": "python_arenas", "# bytes in allocated blocks": "python_objects"}


def _pymalloc_stats() -> dict[str, int]:
    """``sys._debugmallocstats``'s counts of pymalloc (written to the C-level stderr, read back from a file)."""
    found = dict.fromkeys(PYMALLOC_STATS.values(), 0)
    if not hasattr(sys, "_debugmallocstats"):
        return found
    with tempfile.TemporaryFile() as out:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    for line in text.splitlines():
        name, _, value = line.rpartition("=")
        key = PYMALLOC_STATS.get(name.strip())
        if key is not None:
            found[key] = int(value.strip().replace(",", ""))
    found["python_arenas"] *= 2**20 if sys.version_info >= (3, 10) else 2**18  # pymalloc's arena size
    return found


def heap_breakdown() -> dict[str, int]:
    """Where this process's heap is: Python's small-object allocator (pymalloc: its arenas, resident until every
    object in them is freed, and the bytes its live objects take) and glibc's ``malloc`` (bytes in use and free in
    its arenas; ``malloc_trim`` hands back the free pages, ``mallinfo2`` still counts them free).

    Returns:
        ``{"python_arenas", "python_objects", "malloc_in_use", "malloc_free", "malloc_mapped"}`` in bytes
        (``malloc_mapped``: blocks ``malloc`` mapped on their own); zeros where a figure is not available.
    """
    found = {**_pymalloc_stats(), "malloc_in_use": 0, "malloc_free": 0, "malloc_mapped": 0}
    libc = glibc()
    if libc is not None and hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        found.update(malloc_in_use=info.uordblks, malloc_free=info.fordblks, malloc_mapped=info.hblkhd)
    return found


def compiled_graph_count() -> int:
    """How many graphs ``torch.compile`` has compiled in this process (dynamo's ``unique_graphs`` counter), without
    importing ``torch._dynamo`` when nothing has.

    Returns:
        The count (0 while ``torch._dynamo`` is not imported).
    """
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _drop_traced_graph(fn: Any) -> int:
    """Drop the traced-graph handles and debug text along a compiled function's ``__wrapped__`` chain; how many
    handles went."""
    dropped, seen = 0, set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        attributes = getattr(fn, "__dict__", None)
        if isinstance(attributes, dict):
            for name in TRACED_GRAPH_HANDLES:
                dropped += attributes.pop(name, None) is not None
            for name in GRAPH_DEBUG_TEXT:
                if isinstance(attributes.get(name), str):
                    attributes[name] = ""
        fn = getattr(fn, "__wrapped__", None)
    return dropped


def stop_compile_workers() -> None:
    """Shut down inductor's compile worker processes, if any are running (a later compile starts them again); a
    no-op while ``torch._inductor`` is not imported."""
    if "torch._inductor.async_compile" in sys.modules:
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()


def release_compile_state() -> int:
    """Free what ``torch.compile`` keeps after compiling that running its graphs never reads, then hand the freed
    heap back (``release_freed_memory``): dynamo's traced ``GraphModule`` of each compiled graph (held by the graph's
    function through ``TRACED_GRAPH_HANDLES``), the graphs' debug text, the serialized cache entries recorded for
    ``torch.compiler.save_cache_artifacts`` (which then saves only what is compiled later). The compiled graphs,
    their guards and the on-disk caches stay: nothing recompiles.

    Returns:
        How many traced-graph handles were dropped (0 when ``torch._dynamo`` is not imported).
    """
    if "torch._dynamo" not in sys.modules:
        return 0
    dropped = 0
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        for name, value in list(vars(module).items()):
            if isinstance(name, str) and name.startswith("__compiled_fn"):  # where dynamo installs a graph's function
                dropped += _drop_traced_graph(value)
    cache = sys.modules.get("torch.compiler._cache")
    if cache is not None:
        cache.CacheArtifactManager.clear()
    gc.collect()
    release_freed_memory()
    return dropped
