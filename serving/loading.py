"""How the ``zoo`` command and the engine process load a model: ``models.from_pretrained``, then ``--quantize`` or
``--dequantize``.

``quantize`` applies ``model.quantize(scheme)`` to a float checkpoint after loading (a name of
``blocks.names("quantization")``); a checkpoint that is already quantized (a GGUF file loads packed, a checkpoint
saved quantized) refuses it: quantizing packed weights again would add a second rounding to the first.
``dequantize`` loads a quantized checkpoint as float32 weights (what the packed values represent); a float checkpoint
loads as it is.
"""

from __future__ import annotations

from typing import Any

from blocks.quantized import packable_schemes, quantized_modules


def check_request(quantize: str | None, dequantize: bool) -> None:
    """Raise ``ValueError`` for ``quantize`` and ``dequantize`` together or an unknown scheme (the registered ones
    listed), before anything is loaded.

    Args:
        quantize: a scheme name, or None.
        dequantize: whether the packed weights are to be unpacked.

    Raises:
        ValueError: ``dequantize`` not a bool, both given, or an unknown scheme.
    """
    if not isinstance(dequantize, bool):
        raise ValueError(f"dequantize must be True or False, got {dequantize!r}")
    if quantize is not None and dequantize:
        raise ValueError("quantize and dequantize exclude each other; expected one of them at most")
    if quantize is not None and quantize not in packable_schemes():
        raise ValueError(f"unknown quantization scheme {quantize!r}; expected one of {packable_schemes()} (the "
                         "GGUF K-quants are read from GGUF files, not packed here)")


def check_quantization(model: Any, source: str, quantize: str | None, dequantize: bool) -> None:
    """Refuse a request that cannot apply to ``model`` as loaded (which may sit on the meta device).

    Args:
        model: the loaded model.
        source: what it was loaded from, for the message.
        quantize: a scheme name, or ``None``.
        dequantize: whether the packed weights are to be unpacked.

    Raises:
        ValueError: ``quantize`` and ``dequantize`` together, an unknown scheme (the registered ones listed), or
            ``quantize`` for a checkpoint that is already quantized (its schemes named); one line each.
    """
    check_request(quantize, dequantize)
    layers = quantized_modules(model)
    if quantize is not None and layers:
        schemes = ", ".join(sorted({repr(s) for s in layers.values()}))
        raise ValueError(
            f"{source} is already quantized ({len(layers)} layers as {schemes}); --quantize applies to float "
            "checkpoints only: drop it to run the packed weights, or use --dequantize to load them as float32"
        )


def apply_quantization(model: Any, quantize: str | None, dequantize: bool) -> Any:
    """``model`` quantized with ``quantize``, or with its quantized layers unpacked to float32 when ``dequantize``
    (both in place; nothing to do leaves it as it is).

    Args:
        model: the loaded model.
        quantize: a scheme name, or None.
        dequantize: whether to unpack its quantized layers to float32.

    Returns:
        ``model``.
    """
    if quantize is not None:
        model.quantize(quantize)
    elif dequantize and quantized_modules(model):
        model.dequantize().float()
    return model


def load_options(dequantize: bool, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``models.from_pretrained``, with ``dequantize=True`` when asked (a GGUF file then loads as
    float32 without its packed form being built first).

    Args:
        dequantize: whether the weights are to be loaded as float32.
        options: the other ``models.from_pretrained`` options.

    Returns:
        A new dict of options.
    """
    return {**options, "dequantize": True} if dequantize else dict(options)


def load_model(path: str, *, quantize: str | None = None, dequantize: bool = False, **options: Any) -> Any:
    """``models.from_pretrained(path, **options)`` with ``quantize`` or ``dequantize`` applied (see the module
    docstring).

    Args:
        path: a checkpoint folder, ``.gguf`` file or Hub repo id.
        quantize: a scheme to quantize a float checkpoint with, or None.
        dequantize: whether to load a quantized checkpoint as float32.
        **options: further ``models.from_pretrained`` options.

    Returns:
        The model.

    Raises:
        ValueError: as ``check_quantization``, and as ``models.from_pretrained``.
    """
    import models

    check_request(quantize, dequantize)
    model = models.from_pretrained(path, **load_options(dequantize, options))
    check_quantization(model, path, quantize, dequantize)
    return apply_quantization(model, quantize, dequantize)
