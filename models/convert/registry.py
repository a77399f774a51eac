"""Convert Hugging Face ``transformers`` checkpoints into zoo models.

``from_transformers(hf_config, state_dict)`` takes a checkpoint's ``config.json`` dict and its state dict and
returns a ``Converted``: the zoo architecture, the zoo config and the zoo state dict. Converters register by
the config's ``model_type`` with ``@register_converter("gpt2")`` (kind ``hf_converter`` of the ``blocks``
registry). The families live beside this module (``models/convert/<family>.py``, each with its converter,
exporter and presets); ``models/__init__`` imports each of them by name, so registration happens at the top of the
package and this module imports no family.

A converter never returns a model that computes something different from the checkpoint's: a config
value or a tensor the zoo cannot represent raises ``ValueError`` naming it.

The other direction: ``to_transformers(model)`` gives a ``transformers`` config dict and state dict, and
``save_transformers(model, directory)`` writes a folder ``transformers``' ``from_pretrained`` loads
(see ``models.convert.export``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

import blocks

from ..core.base import ZooModel
from ..core.config import ConfigBase

CONVERTER_KIND = "hf_converter"

Converter = Callable[[Mapping[str, Any], Mapping[str, Tensor]], "Converted"]


@dataclasses.dataclass(frozen=True)
class Converted:
    """A ``transformers`` checkpoint translated to the zoo.

    Attributes:
        architecture: the zoo model class (``DecoderLM``, ``EncoderLM``, ``Seq2SeqTransformer``).
        config: an instance of ``architecture.config_class``.
        state_dict: zoo parameter names -> tensors; exactly the keys of ``architecture(config).state_dict()``
            (tied names included) except those in ``allow_missing`` that the checkpoint lacks.
        allow_missing: zoo keys the checkpoint may lack (e.g. the MLM head of a ``BertModel`` checkpoint);
            a loader leaves them at their initialisation and warns.
    """

    architecture: type[ZooModel]
    config: ConfigBase
    state_dict: dict[str, Tensor]
    allow_missing: frozenset[str] = frozenset()


def register_converter(model_type: str) -> Callable[[Converter], Converter]:
    """Decorator registering a converter for ``config.json``'s ``model_type``.

    Raises:
        ValueError: if ``model_type`` already has a converter.
    """
    return blocks.register(CONVERTER_KIND, model_type)


def supported_model_types() -> list[str]:
    """The ``model_type`` values that have a converter, sorted."""
    return blocks.names(CONVERTER_KIND)


def from_transformers(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted:
    """Translate a ``transformers`` checkpoint to a zoo architecture, config and state dict.

    Args:
        hf_config: the checkpoint's ``config.json`` as a dict (it must hold ``model_type``).
        state_dict: the checkpoint's tensors under their ``transformers`` names (a task model such as
            ``GPT2LMHeadModel`` or a base model such as ``GPT2Model``).

    Returns:
        A ``Converted`` whose state dict matches the zoo model's names and shapes.

    Raises:
        ValueError: no ``model_type`` or one without a converter (the supported ones are listed); a config
            value or a tensor the zoo cannot represent exactly; missing tensors; tensors whose shapes do not
            fit the config.
    """
    if not isinstance(hf_config, Mapping) or not isinstance(hf_config.get("model_type"), str):
        got = hf_config.get("model_type") if isinstance(hf_config, Mapping) else type(hf_config).__name__
        raise ValueError(f"a transformers config must be a dict with a string 'model_type', got {got!r}")
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    model_type = hf_config["model_type"]
    supported = supported_model_types()
    if model_type not in supported:
        raise ValueError(f"no converter for transformers model_type {model_type!r}; supported: {supported}")
    converter = blocks.get(CONVERTER_KIND, model_type)
    return check_converted(converter(hf_config, state_dict))


def check_converted(converted: Converted) -> Converted:
    """Complete tied names and check a converter's output against the model its config builds.

    The model is built on the meta device (no memory, no initialisation cost). Tied parameters appear
    under every name they have in the zoo model's state dict, the converter need give only one.

    Returns:
        A ``Converted`` with the tied names filled in, and ``allow_missing`` extended to every name of a tied
        parameter the checkpoint lacks.

    Raises:
        ValueError: keys missing or unknown to the model, conflicting values for one tied parameter, or a
            tensor whose shape differs from the model's.
    """
    with torch.device("meta"):
        model = converted.architecture(converted.config)
    expected = model.state_dict()
    state_dict = dict(converted.state_dict)
    allow_missing = set(converted.allow_missing)

    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        if len(names) < 2:
            continue
        given = [n for n in names if n in state_dict]
        if given:
            first = state_dict[given[0]]
            conflicting = [n for n in given[1:] if state_dict[n] is not first]
            if conflicting:
                raise ValueError(f"tied parameters {names} were given different tensors ({given})")
            state_dict.update({n: first for n in names})
        elif allow_missing & set(names):
            allow_missing.update(names)

    unknown = sorted(set(state_dict) - set(expected))
    if unknown:
        raise ValueError(f"converted state dict has keys the {converted.architecture.__name__} lacks: {unknown}")
    unknown_allowed = sorted(allow_missing - set(expected))
    if unknown_allowed:
        raise ValueError(f"allow_missing names keys the {converted.architecture.__name__} lacks: {unknown_allowed}")
    missing = sorted(set(expected) - set(state_dict) - allow_missing)
    if missing:
        raise ValueError(f"the checkpoint provides no value for {missing}")
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"checkpoint tensor for {name!r} has shape {tuple(tensor.shape)}, but the config builds "
                f"{tuple(expected[name].shape)}: the config and the weights disagree"
            )
    return dataclasses.replace(converted, state_dict=state_dict, allow_missing=frozenset(allow_missing))


__all__ = [
    "CONVERTER_KIND",
    "Converted",
    "check_converted",
    "from_transformers",
    "register_converter",
    "supported_model_types",
]
