"""Hand-written CPU products for the 32-weight GGUF block formats (``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``).

Why by hand: decoding one token reads every weight once, so a product should run at memory speed. Nothing
available does that for these formats with float activations (measured on the SmolLM2-135M shapes, one thread,
``python -m benchmarks.quantized_kernels``): unpacking to float32 and BLAS is 8-20x the time of reading the packed
bytes, inductor's fused unpack-and-reduce 2-5x, torch's ``_weight_int4pack_mm_for_cpu`` is scalar for float32 and
rounds activations to bfloat16 otherwise; llama.cpp's own kernels quantize the activations to 8 bits, which the
contract forbids (a quantized product equals ``F.linear`` on the unpacked weight up to float32 rounding). This
module's kernel unpacks each block in registers (exactly as ``decode`` does: the same float32 weight values) and
multiplies it into up to ``MAX_ROWS`` rows of activations with float32 fused multiply-adds, one pass over the
packed bytes, output rows split over torch's threads.

The source is compiled on first use with the system's C++ compiler (``torch.utils.cpp_extension.load_inline``,
``-O3 -march=native``: AVX-512 where the CPU has it, plain loops the compiler vectorises otherwise) into torch's
extension cache, once per machine and source; ``available()`` is False (and the callers use their own paths)
when there is no compiler, off x86-64/ARM Linux and macOS, or with ``ZOO_CPU_KERNELS=0``. The products are the
dispatcher op ``zoo_ggml::ggml_mm`` (registered by the compiled library, with a fake kernel for tracing), so
eager and compiled calls reach it without Python in between.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("blocks.quantized")

#: Formats this kernel multiplies, and the packed tensors it reads (their order in the op's ``packed`` list).
FORMATS: dict[str, tuple[str, ...]] = {
    "q8_0": ("d", "qs"), "q4_0": ("d", "qs"), "q4_1": ("d", "m", "qs"), "q5_0": ("d", "qh", "qs"),
    "q5_1": ("d", "m", "qh", "qs"),
}
#: Rows multiplied per pass over the weight (more rows are done in passes of this many).
MAX_ROWS = 8
#: Rows up to which the layers use the kernel; from there unpacking chunks for BLAS costs less than more passes
#: (SmolLM2 shapes, one thread: at 16 rows the kernel takes 0.34 ms for 1536 x 576 against 0.38 ms for BLAS on the
#: float weight alone, and 11 against 25 ms for the 49152 x 576 head).
KERNEL_ROWS = 32

#: The kernels' C++ source (next to this module; compiled on first use).
_SOURCE = (Path(__file__).parent / "ggml_kernels.cpp").read_text()

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _extension() -> Any:
    """The compiled extension (built or loaded from torch's cache on the first call), or None when it cannot be."""
    with _LOCK:
        if "module" not in _STATE:
            _STATE["module"] = None
            if os.environ.get("ZOO_CPU_KERNELS", "1") != "0":
                # -march=native: the name carries the CPU's flags, so a cache shared between machines never hands
                # one a binary built for another.
                key = hashlib.sha256((_SOURCE + _cpu_flags() + torch.__version__).encode()).hexdigest()[:16]
                try:
                    from torch.utils.cpp_extension import load_inline

                    load_inline(f"zoo_ggml_kernels_{key}", cpp_sources=_SOURCE, extra_cflags=["-O3", "-march=native"],
                                is_python_module=False, verbose=False)
                    torch.library.register_fake("zoo_ggml::ggml_mm")(_fake)
                    _STATE["module"] = torch.ops.zoo_ggml
                except Exception as e:  # no compiler, headers or a supported CPU: the callers' own paths run
                    logger.warning("the CPU kernels for GGUF blocks could not be built (%s); using the slower "
                                   "unpack-and-multiply paths", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return _STATE["module"]


def available() -> bool:
    """Whether the kernels are built (building them on the first call).

    Returns:
        False without a C++ compiler, with ``ZOO_CPU_KERNELS=0``, or when the build failed.
    """
    return _extension() is not None


def ggml_mm(x: Tensor, scheme: str, packed: list[Tensor]) -> Tensor:
    """``x @ unpack().T`` for a layer of a ``FORMATS`` scheme, from its packed tensors (``FORMATS[scheme]`` order):
    the op ``zoo_ggml::ggml_mm`` (``available()`` must have built it).

    Args:
        x: the inputs, float32.
        scheme: the layer's scheme.
        packed: its packed tensors, in ``FORMATS[scheme]`` order.

    Returns:
        The product, float32.

    Shapes: ``x (rows, in)`` float32, packed tensors with ``out`` rows -> ``(rows, out)`` float32.

    Raises:
        ValueError: a scheme not in ``FORMATS``, a count of packed tensors other than the scheme's, or ``x`` not
            a 2-d float32 tensor whose width is a multiple of 32.
    """
    return torch.ops.zoo_ggml.ggml_mm(_checked_x(x), [_format_id(scheme, packed)], packed)


def ggml_mm_joint(x: Tensor, weights: list[tuple[str, list[Tensor]]]) -> Tensor:
    """``x`` times several weights of its width, each of a ``FORMATS`` scheme, side by side in one output (one op
    call: q, k and v; gate and up): ``torch.cat([ggml_mm(x, s, p) for s, p in weights], -1)``.

    Args:
        x: the inputs, float32.
        weights: ``(scheme, packed tensors in FORMATS[scheme] order)`` per weight.

    Returns:
        The products, float32, in the order of ``weights``.

    Shapes: ``x (rows, in)``, weights with ``out_i`` rows -> ``(rows, sum of out_i)``.

    Raises:
        ValueError: as ``ggml_mm``, for any of the weights, or no weights.
    """
    if not weights:
        raise ValueError("ggml_mm_joint needs at least one (scheme, packed tensors) pair, got none")
    return torch.ops.zoo_ggml.ggml_mm(_checked_x(x), [_format_id(scheme, packed) for scheme, packed in weights],
                                      [t for _, packed in weights for t in packed])


_FORMAT_IDS = {scheme: i for i, scheme in enumerate(FORMATS)}
_FIELDS = [len(names) for names in FORMATS.values()]


def _format_id(scheme: str, packed: list[Tensor]) -> int:
    """The op's format number of ``scheme``, after its packed tensors are counted (ValueError otherwise)."""
    format_id = _FORMAT_IDS.get(scheme) if isinstance(scheme, str) else None
    if format_id is None:
        raise ValueError(f"scheme={scheme!r}: the GGUF kernels multiply one of {list(FORMATS)}")
    if len(packed) != _FIELDS[format_id]:
        raise ValueError(f"scheme {scheme!r} takes {_FIELDS[format_id]} packed tensors "
                         f"({', '.join(FORMATS[scheme])}), got {len(packed)}")
    return format_id


def _checked_x(x: Tensor) -> Tensor:
    """``x`` if the op can take it: a 2-d float32 tensor whose width is a multiple of the 32-weight block."""
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % 32:
        described = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x={described}: expected a 2-d float32 tensor whose width is a multiple of 32")
    return x


def _fake(x: Tensor, formats: list[int], packed: list[Tensor]) -> Tensor:
    out, t = 0, 0
    for format_id in formats:
        t += _FIELDS[format_id]
        out += packed[t - 1].shape[0]  # qs, the last of each weight's tensors
    return x.new_empty(x.shape[0], out)


def usable(scheme: str, x: Tensor, packed: dict[str, Tensor]) -> bool:
    """Whether ``ggml_mm`` can multiply ``x`` by these packed tensors: a format it knows, float32 on the CPU, no
    gradient wanted, packed tensors in their file dtypes, and the kernel built (built here on an eager call; a
    compiled graph uses it when an eager call has built it: decoding prefills eagerly first).

    Args:
        scheme: the layer's scheme.
        x: the inputs.
        packed: its packed tensors by name.

    Returns:
        True when the kernel applies.

    Shapes: x ``(rows, in)``.
    """
    return (scheme in FORMATS and x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] % 32 == 0
            and not (torch.is_grad_enabled() and x.requires_grad) and packed["d"].dtype == torch.float16
            and all(packed[name].device.type == "cpu" and packed[name].is_contiguous() for name in FORMATS[scheme])
            and (_STATE.get("module") is not None if torch.compiler.is_compiling() else available()))
