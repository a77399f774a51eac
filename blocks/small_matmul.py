"""Linear layers for a handful of rows (decoding), written so that inductor reads each weight once, fast.

Decoding multiplies a few rows (one token per sequence, a few beams, a few draft tokens) by every weight
matrix: the work is reading the weights. The BLAS kernels behind ``F.linear`` are tuned for large products and
read a ``(out, in)`` weight slowly when there are 1–4 rows (measured on 2 CPU cores, fp32, the weights of a
6 × 512 decoder: 11 GB/s for 1 row, worse for 2–4, against 50 GB/s for ``tensor.sum``). So, by rows:

- 1 row (float weight): a broadcast multiply and a sum over ``in``, which inductor compiles into a single
  vectorised pass over the weight (35 GB/s), fused with what surrounds it (a scale, a bias);
- 2–4 rows (float weight): BLAS as ``weight @ x.T`` with ``x.T`` left strided, which streams the weight fast;
- otherwise (5–8 rows, or an int8 weight whose conversion is fused into the pass): a row-outer multiply-reduce.

``small_rows_linear`` is that product; ``SmallRowsLinear`` is a ``TorchFunctionMode`` that routes every
``F.linear`` (so every ``nn.Linear`` and every tied head) with at most ``MAX_ROWS`` rows through it. It is meant
to be entered *inside* a function given to ``torch.compile`` (dynamo traces the mode away); in eager mode the
broadcast form would materialise ``rows × out × in`` floats, so there ``F.linear`` is the better choice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

#: Rows up to which the reduction form is used (measured in a compiled 6 × 512 decoder step: 2–3× faster than
#: BLAS for 1–2 rows, equal at 4–8).
MAX_ROWS = 8
#: Rows up to which the reduction runs weight-row-outer (each weight row loaded once for every input row). Faster
#: in isolation for up to 4 rows, but when inductor fuses the producer of ``x`` (an activation, a norm) into it,
#: it stores ``x`` transposed and loops over the outputs serially: 3× slower than BLAS at 4 rows. So: 1 row only,
#: and float weights only (an int8 weight reads faster row-outer: 1.9 against 2.7 ms per decoder step).
_WEIGHT_OUTER_ROWS = 1
#: Rows up to which a float weight goes through BLAS as ``weight @ x.T`` (x.T not made contiguous), which reads the
#: weight far faster than ``x @ weight.T`` does for 2–4 rows (decoder step at 4 rows: 8.9 ms against 15 ms for
#: ``F.linear`` and 13 ms for the reduction); from 5 rows the reduction is faster.
_WEIGHT_TIMES_COLUMNS_ROWS = 4


def small_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """``x @ (weight · scale[:, None]).T + bias`` in the form that reads ``weight`` fastest (compiled decoding).

    Args:
        x: ``(..., in)`` activations.
        weight: ``(out, in)``, any dtype (an int8 weight is converted inside the fused kernel).
        bias: optional ``(out,)``.
        scale: optional ``(out,)`` per-output-channel scale (weight-only quantization).

    Returns:
        ``(..., out)`` in ``x``'s dtype.

    Raises:
        ValueError: ``x``'s last dimension is not ``weight``'s ``in``.

    Shapes: x ``(..., in)``, weight ``(out, in)`` -> ``(..., out)``.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"small_rows_linear needs x (..., {weight.shape[-1]}) and a 2-d weight, got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    rows = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    # An integer weight is not converted here: the multiply promotes it inside the fused kernel, and no
    # separate conversion exists that freezing could fold into a float (4-byte) constant.
    w = weight.to(x.dtype) if weight.is_floating_point() else weight
    if flat.shape[0] <= _WEIGHT_OUTER_ROWS and weight.is_floating_point():
        # (out, rows, in) summed over in: each weight row is loaded once and used for every input row.
        y = (flat[None, :, :] * w[:, None, :]).sum(-1).t()
    elif flat.shape[0] <= _WEIGHT_TIMES_COLUMNS_ROWS and weight.is_floating_point():
        # BLAS on weight @ x.T with x.T left strided: the weight is the streamed operand.
        y = torch.mm(w, flat.t()).t()
    else:
        y = (flat[:, None, :] * w[None, :, :]).sum(-1)
    if scale is not None:
        y = y * scale.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*rows, weight.shape[0])


def _rows(x: Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1) if x.dim() else 0


class SmallRowsLinear(TorchFunctionMode):
    """Route ``F.linear`` calls with at most ``max_rows`` rows through ``small_rows_linear``.

    Enter it inside the function given to ``torch.compile``::

        def step(model, tokens):
            with SmallRowsLinear():
                return model(tokens)

    Args:
        max_rows: the most rows (product of the leading dimensions) routed to ``small_rows_linear`` (default:
            the module's ``MAX_ROWS``, read when the mode is made).

    Raises:
        ValueError: ``max_rows`` is not a non-negative int.
    """

    def __init__(self, max_rows: int | None = None) -> None:
        super().__init__()
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
            raise ValueError(f"max_rows must be an int >= 0 or None, got {max_rows!r}")
        self.max_rows = MAX_ROWS if max_rows is None else max_rows

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.dim() == 2 and 0 < _rows(x) <= self.max_rows and not torch.is_grad_enabled():
                return small_rows_linear(x, weight, bias)
        return func(*args, **kwargs)
