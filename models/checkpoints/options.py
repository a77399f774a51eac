"""The keyword arguments of every ``from_pretrained`` (``LoadOptions``), and their checking and parsing.

``parse_options`` checks every value before anything is read or downloaded; ``parse_dtype`` is also the dtype
argument of ``models.gguf.read_gguf``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

import blocks

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


class LoadOptions(TypedDict, total=False):
    """The keyword arguments of every ``from_pretrained``, stated once.

    ``models.from_pretrained``, ``Model.from_pretrained`` and ``load_pretrained`` all take ``**LoadOptions``.

    Attributes:
        revision: Hub branch, tag or commit sha (default ``"main"``); not allowed for a local folder or file.
        device: where the weights go (default: CPU).
        dtype: floating dtype of the model (a ``torch.dtype`` or a name such as ``"bfloat16"``). Default: the
            checkpoint's own dtype, i.e. the one most of its floating weights are stored in; a tensor stored in
            another floating dtype (one float64 tensor among float32 ones) is cast to it, with a warning naming it.
        attention_backend: a registered ``attention_backend`` to switch every attention module to.
        token: Hub token (default: ``HF_TOKEN`` or the one saved by ``hf auth login``; ``False``: none).
        endpoint: Hub URL (default: ``HF_ENDPOINT`` or huggingface.co).
        gguf_file: a ``.gguf`` file inside the folder or Hub repo to load instead of its checkpoint (the first
            part of a split set brings the others).
        head: give the model this registered head (``"sequence_classification"`` ...) instead of the checkpoint's;
            weights the checkpoint lacks for it are initialised, with a warning naming them.
        head_options: options of the head (``num_labels``, ``id2label``, ``pooling`` ...), merged over the
            checkpoint's when the head stays the same.
        num_labels / id2label: shorthands for those ``head_options``.
        dequantize: load a quantized single file (a GGUF file's Q8_0 ... Q6_K tensors) as float weights
            (``dtype``, default float32) instead of keeping its blocks packed (the default).
    """

    revision: str | None
    device: str | torch.device | None
    dtype: str | torch.dtype | None
    attention_backend: str | None
    token: str | bool | None
    endpoint: str | None
    gguf_file: str | None
    head: str | None
    head_options: dict[str, Any] | None
    num_labels: int | None
    id2label: dict[Any, str] | None
    dequantize: bool


@dataclass(frozen=True)
class ParsedOptions:
    """``LoadOptions`` checked and parsed.

    Attributes:
        revision: the Hub revision, or None.
        device: the target device, or None.
        dtype: the target floating dtype, or None.
        attention_backend: a registered backend to switch to, or None.
        token: the Hub token (False: none), or None.
        endpoint: the Hub URL, or None.
        gguf_file: a ``.gguf`` file inside the folder or repo, or None.
        head: a head to give the model, or None.
        head_options: that head's options (``num_labels`` and ``id2label`` merged in), or None.
        dequantize: load quantized GGUF tensors as float weights.
    """

    revision: str | None = None
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    attention_backend: str | None = None
    token: str | bool | None = None
    endpoint: str | None = None
    gguf_file: str | None = None
    head: str | None = None
    head_options: dict[str, Any] | None = None
    dequantize: bool = False


def parse_options(options: Mapping[str, Any]) -> ParsedOptions:
    """Check every ``LoadOptions`` value before anything is read or downloaded.

    Args:
        options: the keyword arguments ``from_pretrained`` received.

    Returns:
        The parsed options.

    Raises:
        TypeError: an unknown keyword argument, or a value of the wrong type (naming the option).
        ValueError: a value out of range (a ``gguf_file`` outside the folder, a bad device or dtype name).
    """
    known = sorted(LoadOptions.__annotations__)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"from_pretrained() got unexpected keyword argument(s) {unknown}; it takes {known}")
    for name in ("revision", "attention_backend", "endpoint", "gguf_file", "head"):
        value = options.get(name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string or None, got {type(value).__name__} {value!r}")
    token = options.get("token")
    if token is not None and not isinstance(token, (str, bool)):
        raise TypeError(f"token must be a string, a bool or None, got {type(token).__name__}")  # never the value
    backend = options.get("attention_backend")
    if backend is not None:
        blocks.get("attention_backend", backend)  # fail before any download
    gguf_file = options.get("gguf_file")
    if gguf_file is not None and (not gguf_file.lower().endswith(".gguf") or gguf_file.startswith(("/", "\\"))
                                  or ".." in gguf_file.replace("\\", "/").split("/")):
        raise ValueError(f"gguf_file={gguf_file!r}: expected a relative path to a .gguf file inside the folder or repo")
    dequantize = options.get("dequantize", False)
    if not isinstance(dequantize, bool):
        raise TypeError(f"dequantize must be True or False, got {type(dequantize).__name__} {dequantize!r}")
    head_options = options.get("head_options")
    if head_options is not None and not isinstance(head_options, Mapping):
        raise TypeError(f"head_options must be a dict of head options, got {type(head_options).__name__}")
    head_options = dict(head_options or {})
    for name in ("num_labels", "id2label"):
        if options.get(name) is not None:
            head_options[name] = options[name]
    if options.get("head") is not None:
        blocks.get("head", options["head"])  # fail before any download
    return ParsedOptions(
        head=options.get("head"),
        head_options=head_options or None,
        revision=options.get("revision"),
        device=parse_device(options.get("device")),
        dtype=parse_dtype(options.get("dtype")),
        attention_backend=backend,
        token=token,
        endpoint=options.get("endpoint"),
        gguf_file=gguf_file,
        dequantize=dequantize,
    )


def parse_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``).

    Args:
        device: a device or its name.

    Returns:
        The device, or None.

    Raises:
        ValueError: not a device name, or CUDA asked for where it is not available.
    """
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a valid torch device (e.g. 'cpu', 'cuda:0')") from e
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return parsed


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A floating ``torch.dtype`` from itself or its name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"`` …);
    ``None`` stays ``None``.

    Args:
        dtype: a dtype or its name.

    Returns:
        The dtype, or None.

    Raises:
        ValueError: an unknown name, or a dtype that is not floating.
    """
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not a floating dtype name; expected one of {sorted(_DTYPES)}")
        return _DTYPES[dtype.removeprefix("torch.")]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} must be a floating torch.dtype (float32, float16, bfloat16) or its name")
    return dtype
