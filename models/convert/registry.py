"""Convert Hugging Face ``transformers`` checkpoints into zoo models.

``from_transformers(hf_config, state_dict)`` takes a checkpoint's ``config.json`` dict and its state dict and
returns a ``Converted``: the zoo architecture, the zoo config and the zoo state dict. Converters register by
the config's ``model_type`` with ``@register_converter("gpt2")`` (kind ``hf_converter`` of the ``blocks``
registry). The families live beside this module (``models/convert/<family>.py``, each with its converter,
exporter and presets); ``models/__init__`` imports each of them by name, so registration happens at the top of the
package and this module imports no family.

A converter never returns a model that computes something different from the checkpoint's: a config
value or a tensor the zoo cannot represent raises ``ValueError`` naming it.

Sizes are bounded before anything is allocated: a config may not count more layers than the checkpoint stores
(checked in O(tensors) before a converter runs), and the model it builds may not hold more elements than the
checkpoint's tensors (``build_bounded``, on the meta device; the zoo loader calls it for zoo checkpoints too).

The other direction: ``to_transformers(model)`` gives a ``transformers`` config dict and state dict, and
``save_transformers(model, directory)`` writes a folder ``transformers``' ``from_pretrained`` loads
(see ``models.convert.export``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn

import blocks

from ..core.base import ZooModel
from ..core.config import ConfigBase
from ..core.meta_build import meta_build
from .bounds import check_hf_counts, check_zoo_counts

CONVERTER_KIND = "hf_converter"
#: kind of ``models.convert.tasks.convert_task`` (a task class's checkpoint), looked up so this module imports it not.
TASK_CONVERT_KIND = "hf_task_convert"

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

    Args:
        model_type: the ``transformers`` family (``"llama"``).

    Returns:
        The decorator; it returns the converter unchanged.

    Raises:
        ValueError: if ``model_type`` already has a converter.
    """
    return blocks.register(CONVERTER_KIND, model_type)


def supported_model_types() -> list[str]:
    """The ``model_type`` values that have a converter, sorted.

    Returns:
        The model types.
    """
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

    Shapes: every tensor as the checkpoint stores it.
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
    _check_hf_layer_counts(hf_config, state_dict)  # before a converter loops over the layers or builds anything
    check_hf_counts(hf_config, state_dict)  # experts, labels, widths, positions: before anything loops over them
    converter = blocks.get(CONVERTER_KIND, model_type)
    if TASK_CONVERT_KIND in blocks.kinds():  # task classes (models.convert.tasks, registered by the families)
        converted = blocks.get(TASK_CONVERT_KIND, "convert")(hf_config, state_dict)
        if converted is not None:
            return check_converted(converted)
    return check_converted(converter(hf_config, state_dict))


def check_converted(converted: Converted) -> Converted:
    """Complete tied names and check a converter's output against the model its config builds.

    The model is built on the meta device (no memory, no initialisation cost). Tied parameters appear
    under every name they have in the zoo model's state dict, the converter need give only one.

    Args:
        converted: a converter's output.

    Returns:
        A ``Converted`` with the tied names filled in, and ``allow_missing`` extended to every name of a tied
        parameter the checkpoint lacks.

    Raises:
        ValueError: keys missing or unknown to the model, conflicting values for one tied parameter, a
            tensor whose shape differs from the model's, or a config larger than the weights (``build_bounded``).
    """
    model = build_bounded(converted.architecture, converted.config, converted.state_dict)
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
                f"{tuple(expected[name].shape)}{_fields_named(converted.config, expected[name].shape, tensor.shape)}"
                ": the config and the weights disagree"
            )
    return dataclasses.replace(converted, state_dict=state_dict, allow_missing=frozenset(allow_missing))


# ------------------------------------------------------------------------------- sizes bounded before allocation
#: The model a config builds may hold at most ``1 + SLACK_FRACTION`` times the elements its checkpoint stores, plus
#: ``SLACK_ELEMENTS``: room for what a checkpoint legitimately lacks (non-persistent tables such as sinusoids, a head
#: a base-model checkpoint leaves at its initialisation), never for a config that claims more than its weights hold.
SLACK_FRACTION = 1 / 16
SLACK_ELEMENTS = 1 << 22
#: ``transformers`` config fields that count the layers of a stack (each family's name for ``num_hidden_layers``).
HF_LAYER_FIELDS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers"
)
_INDEXED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def stored_layers(names: Iterable[str]) -> dict[str, set[int]]:
    """The layer indices stored under each prefix: ``{"model.layers": {0, 1}}`` for ``model.layers.0.*`` and
    ``model.layers.1.*`` (the first numeric part of each tensor name is its layer index).

    Args:
        names: tensor names.

    Returns:
        Prefix -> layer indices.
    """
    stacks: dict[str, set[int]] = {}
    for name in names:
        match = _INDEXED.match(name)
        if match is not None:
            stacks.setdefault(match[1], set()).add(int(match[2]))
    return stacks


def _check_hf_layer_counts(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> None:
    """Refuse a ``transformers`` config counting more layers than any stack of the checkpoint stores.

    Cost O(tensors), whatever the config says: a converter loops over the layers and builds the model on the meta
    device, which for ``num_hidden_layers = 10**6`` would run for hours.
    """
    most = max((len(indices) for indices in stored_layers(state_dict).values()), default=0)
    for field in HF_LAYER_FIELDS:
        value = hf_config.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            raise ValueError(
                f"{hf_config['model_type']} config field {field}={value}, but no stack of the checkpoint stores more "
                f"than {most} layers: the config and the weights disagree"
            )


def check_layer_counts(config: ConfigBase, names: Iterable[str], source: str = "") -> None:
    """Check each layer count of a zoo config (``n_layers``, ``n_encoder_layers``, ...) against the layers stored.

    A field ``n_<stack>`` counts the modules ``<stack>.<i>``, whose tensors are named ``<stack>.<i>.*``. Cost
    O(tensors) whatever the config says, so it runs before any model (even on the meta device) is built.

    Args:
        config: the zoo config.
        names: the stored tensors' names (zoo names).
        source: where they come from, for the message.

    Raises:
        ValueError: a count that differs from the number of layer indices stored under its stack (field named).
    """
    stacks = stored_layers(names)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not (field.name.startswith("n_") and field.name.endswith("layers") and isinstance(value, int)):
            continue
        stack = field.name.removeprefix("n_")
        stored = len(stacks.get(stack, ()))
        if value != stored:
            raise ValueError(
                f"{_prefix(source)}config field {field.name}={value}, but the checkpoint stores {stored} layers "
                f"({stack}.<i>.*): the config and the weights disagree"
            )


def build_bounded(
    architecture: type[nn.Module], config: ConfigBase, state: Mapping[str, Tensor], source: str = ""
) -> nn.Module:
    """Build ``architecture(config)`` on the meta device, after checking that the real build stays bounded.

    The layer counts are checked first (``check_layer_counts``), so the meta build is bounded by the checkpoint's
    tensor count; then the model's parameters and buffers together may hold at most ``1 + SLACK_FRACTION`` times
    the elements ``state`` stores, plus ``SLACK_ELEMENTS`` (a tensor given under several names counts once).

    Args:
        architecture: the model class.
        config: its config.
        state: the checkpoint's tensors (zoo names).
        source: where they come from, for messages.

    Shapes: state's tensors as stored.

    Returns:
        The model on the meta device (no memory, no initialisation cost).

    Raises:
        ValueError: a layer count that disagrees with the layers stored, or a config that builds more elements
            than allowed: the tensors that outgrow the checkpoint's are listed with the config fields behind them.
    """
    check_layer_counts(config, state, source)
    check_zoo_counts(config, state, source)
    with meta_build():
        model = architecture(config)
    stored = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    built = sum(t.numel() for t in {id(t): t for t in tensors.values()}.values())
    if built <= stored * (1 + SLACK_FRACTION) + SLACK_ELEMENTS:
        return model
    grown = sorted(
        (name for name, t in tensors.items() if name not in state or state[name].numel() < t.numel()),
        key=lambda name: -tensors[name].numel(),
    )
    listed = [
        f"{name} {tuple(tensors[name].shape)}"
        + (f" (stored {tuple(state[name].shape)})" if name in state else " (not stored)")
        + _fields_named(config, tensors[name].shape, state[name].shape if name in state else ())
        for name in grown[:5]
    ]
    raise ValueError(
        f"{_prefix(source)}the config builds a {architecture.__name__} of {built:,} elements, but the checkpoint "
        f"stores only {stored:,}: the config and the weights disagree; largest differences: {'; '.join(listed)}"
    )


def _prefix(source: str) -> str:
    return f"{source}: " if source else ""


def _fields_named(config: ConfigBase, built: Iterable[int], stored: Iterable[int]) -> str:
    """`` from config field vocab_size=...`` naming the integer fields whose values are the dimensions in which
    ``built`` departs from ``stored`` (its largest dimension when the ranks differ), or ``""`` when none is."""
    built, stored = tuple(built), tuple(stored)
    if len(built) == len(stored):
        dims = {b for b, s in zip(built, stored, strict=True) if b != s}
    else:
        dims = {max(built, default=0)}
    fields = [
        f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
        if type(getattr(config, f.name)) is int and getattr(config, f.name) in dims
    ]
    return f" from config field {', '.join(fields)}" if fields else ""


__all__ = [
    "CONVERTER_KIND",
    "SLACK_ELEMENTS",
    "SLACK_FRACTION",
    "Converted",
    "build_bounded",
    "check_converted",
    "check_layer_counts",
    "from_transformers",
    "register_converter",
    "stored_layers",
    "supported_model_types",
]
