"""Finite-value checks of what an exporter writes: a NaN or inf weight (or a value the file's type turns into inf)
is refused with the tensor named, before anything is written, instead of a file that computes NaN."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

#: the largest finite value of the float types files store: a value beyond it is written as inf.
LARGEST = {"F16": float(torch.finfo(torch.float16).max), "BF16": float(torch.finfo(torch.bfloat16).max),
           "F32": float(torch.finfo(torch.float32).max)}


def check_finite(tensors: Mapping[str, Tensor], what: str, largest: float | None = None, type_name: str = "") -> None:
    """Refuse tensors holding NaN or inf, or (``largest``) values whose magnitude exceeds ``largest``.

    Meta tensors (stand-ins without values) and integer tensors are skipped. Cost: one pass over each tensor.

    Shapes: any tensors.

    Args:
        tensors: name -> tensor, as the file will name them.
        what: the export, for messages (``"GGUF export"``).
        largest: the largest magnitude the target type holds (``LARGEST["F16"]``), or None (finiteness only).
        type_name: the target type, for messages.

    Raises:
        ValueError: naming the first bad tensor, how many values are bad, and one of them.
    """
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor) or tensor.is_meta or not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        bad = ~torch.isfinite(tensor.detach())
        if bool(bad.any()):
            example = float(tensor.detach()[bad].flatten()[0])
            raise ValueError(f"{what}: tensor {name!r} holds {int(bad.sum())} non-finite values (e.g. {example}); "
                             "refusing to write weights that compute NaN")
        if largest is not None and tensor.numel():
            peak = float(tensor.detach().abs().max())
            if peak > largest:
                raise ValueError(f"{what}: tensor {name!r} holds {peak:g}, beyond the largest {type_name} value "
                                 f"({largest:g}): it would be written as inf")
