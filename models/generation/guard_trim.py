"""Fewer guard checks for the steps of a decoding loop that skip dynamo's guards.

``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` still checks a compiled graph's *diff guards*: those that
could tell its cache entries apart, which by dynamo's default include a tensor-match guard on every tensor that is
not an ``nn.Parameter``, with the attribute lookups that reach it. A model's buffers are such tensors: the packed
weights of a GGUF model are buffers (two to four per layer), so each step of SmolLM2-135M Q8_0 checked ~1,460
guards, ~1 ms of the ~18 ms a token takes on one core.

Within one decoding loop the model is the one the loop's guarded first call checked, so ``trim_module_guards``
drops the guards on the model's attributes from the diff guards (the step's own inputs — tokens, mask, caches —
are still checked). Choosing among several cache entries stays correct: a guarded call moves the entry it matched
to the front of dynamo's cache list, and the skipping steps that follow take the first entry whose remaining diff
guards pass, which is that one.

It reaches into dynamo's guard managers (``torch._dynamo``, pinned with torch); if those change, it logs once and
leaves the guards as they are.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence

logger = logging.getLogger("models.generation")

_FAILED: list[bool] = []


def trim_module_guards(code: types.CodeType, module_args: Sequence[int]) -> int:
    """Remove the guards on positional arguments ``module_args`` (and everything reached through them) from the
    diff guards of each compiled entry of ``code`` not trimmed since dynamo last set them.

    Args:
        code: the code object ``torch.compile`` compiled (the compiled function's ``__code__``).
        module_args: positions of the arguments whose attributes the skipping steps leave unchecked (the model).

    Returns:
        How many cache entries were trimmed by this call.
    """
    if _FAILED or not module_args:
        return 0
    prefixes = tuple(f"L['args'][{i}]" for i in module_args)
    trimmed = 0
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch.utils._ordered_set import OrderedSet

        for entry in _debug_get_cache_entry_list(code):
            manager = entry.guard_manager
            # Dynamo gives every entry a new set of diff sources when it compiles another: trim those again.
            if getattr(manager, "zoo_trimmed", None) is manager.diff_guard_sources:
                continue
            kept = OrderedSet(source for source in manager.diff_guard_sources
                              if not source.startswith(prefixes) and source not in ("L['args']", "L"))
            manager.diff_guard_sources = kept
            manager.collect_diff_guard_sources()  # adds back the containers of what is kept (L['args'], L)
            manager.populate_diff_guard_manager()
            manager.zoo_trimmed = manager.diff_guard_sources
            trimmed += 1
    except Exception as e:  # dynamo's internals changed: keep every guard
        _FAILED.append(True)
        logger.warning("could not trim the decoding step's guards (%s: %s); every step checks them",
                       type(e).__name__, e)
    return trimmed
