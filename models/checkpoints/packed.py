"""Loading a state dict that holds ``PackedWeight`` stand-ins (a GGUF file's quantized tensors): the layers they
name become quantized layers holding the file's packed blocks (``blocks.quantized``)."""

from __future__ import annotations

import logging

from torch import Tensor, nn

from blocks.quantized import PackedWeight, QuantizedEmbedding, quantized_skeleton

logger = logging.getLogger("models.checkpoints")


def with_changed_decoded(
    state: dict[str, Tensor], converted: dict[str, Tensor], source: str
) -> dict[str, Tensor] | None:
    """The reader's ``state`` with the stand-ins a converter changed decoded to float, or None if none changed.

    A converter that only renames a weight passes its stand-in along; one that changes it (GPT-2's transposed
    ``Conv1D``, a fused projection split) leaves a plain meta tensor in ``converted``. The stand-ins not passed
    along are then decoded (``materialize``), and the caller converts again: those layers load as float weights.

    Args:
        state: the reader's tensors, stand-ins included.
        converted: the converter's output.
        source: the file, for the log.

    Returns:
        The new state, or None.

    Shapes: tensors as stored.
    """
    if not any(t.device.type == "meta" and not isinstance(t, PackedWeight) for t in converted.values()):
        return None
    kept = {id(t) for t in converted.values() if isinstance(t, PackedWeight)}
    decoded = [k for k, t in state.items() if isinstance(t, PackedWeight) and id(t) not in kept]
    shown = ", ".join(decoded[:10]) + (f", ... ({len(decoded) - 10} more)" if len(decoded) > 10 else "")
    logger.info("%s: %d quantized tensor(s) change on conversion and load as float: %s", source, len(decoded), shown)
    return {k: t.materialize() if k in decoded else t for k, t in state.items()}


def packed_into_skeleton(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Give ``model`` a quantized layer (or embedding) where ``state`` holds a ``PackedWeight``, in place, and return
    the state with the packed tensors in place of the stand-ins.

    One stand-in under two names (a head tied to the embedding) is read once and becomes one packed layer.

    Args:
        model: the model skeleton (changed in place).
        state: its tensors, ``PackedWeight`` stand-ins included.

    Returns:
        The state to load.

    Shapes: tensors as the model's.
    """
    stand_ins = {name.removesuffix(".weight"): t for name, t in state.items() if isinstance(t, PackedWeight)}
    if not stand_ins:
        return state
    quantized_skeleton(model, {name: t.scheme for name, t in stand_ins.items()})
    state = {name: t for name, t in state.items() if not isinstance(t, PackedWeight)}
    loaded: dict[int, dict[str, Tensor]] = {}
    for name, stand_in in stand_ins.items():
        if id(stand_in) not in loaded:
            loaded[id(stand_in)] = stand_in.load_state()
        table = "table." if isinstance(model.get_submodule(name), QuantizedEmbedding) else ""
        state.update({f"{name}.{table}{key}": tensor for key, tensor in loaded[id(stand_in)].items()})
    return state
