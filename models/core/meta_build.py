"""Building a model on the meta device without running its initialisation: ``meta_build()``.

Meta tensors hold no values, yet ``nn.Module`` constructors still call ``normal_``, ``trunc_normal_``'s ``erfinv_``
and the like on them, and torch runs those ops on meta tensors through its Python references, whose first use
imports ``torch._dynamo`` and ``sympy`` (seconds and ~100 MiB resident in a fresh process that never compiles).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

#: in-place methods that change a tensor's shape or flags, which a meta build must still run.
SHAPING = frozenset({
    "requires_grad_", "resize_", "resize_as_", "set_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_",
    "swapaxes_", "as_strided_", "detach_", "share_memory_", "rename_", "refine_names_", "sparse_resize_",
    "sparse_resize_and_clear_",
})


class MetaBuild(TorchFunctionMode):
    """Used inside ``torch.device("meta")``: skips in-place value updates of meta tensors (initialisation) and makes
    ``arange`` of Python numbers a CPU tensor (its few values are cheap; arithmetic on it then stays off torch's
    Python references); every other call runs as usual. Enter it as a context manager inside
    ``torch.device("meta")``, as ``meta_build()`` does.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes its tensor by keyword
        if name.endswith("_") and not name.endswith("__") and name not in SHAPING and _is_meta(target):
            return target
        if (
            func is torch.arange and args and all(type(v) in (int, float) for v in args)
            and set(kwargs) <= {"dtype", "requires_grad"}
        ):
            # Real values on the CPU: what is computed from them (rotary tables) then runs as ordinary small CPU
            # ops instead of meta ops through torch's Python references.
            return func(*args, **kwargs, device="cpu")
        flat, spec = tree_flatten((args, kwargs))
        if any(_is_meta(v) for v in flat) and any(isinstance(v, Tensor) and v.device.type == "cpu" for v in flat):
            # A CPU value from ``arange`` meets a meta tensor: the result is meta, as it would have been.
            args, kwargs = tree_unflatten([v.to("meta") if isinstance(v, Tensor) else v for v in flat], spec)
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_build() -> Iterator[None]:
    """Inside the block, modules are built on the meta device (no memory) and their initialisation is skipped.

    Returns:
        A context manager; nothing is yielded.
    """
    with torch.device("meta"), MetaBuild():
        yield


def _is_meta(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_meta
