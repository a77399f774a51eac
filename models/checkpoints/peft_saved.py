"""A model's task head saved beside its LoRA adapter, as ``peft``'s ``modules_to_save``.

Fine-tuning a LoRA on a classifier trains its new head too. ``peft`` saves such modules whole (``modules_to_save`` in
``adapter_config.json``, their tensors as ``base_model.model.<module>.<param>`` beside the LoRA weights) and puts
them in place of the base model's modules when it loads the adapter. ``save_adapter`` writes the task head so when
any of its parameters is trainable (``add_adapter`` freezes the model; unfreeze the head to train it with the LoRA:
``model.head.requires_grad_(True)``), under the module names of the ``transformers`` task class the model exports to
(``classifier``, ``bert.pooler.dense``; the zoo's ``head.*`` where no family represents the model). ``load_adapter``
reads them back into ``model.head`` (modules the file does not hold keep their weights, as in ``peft``) and leaves
the head trainable, as ``peft`` leaves saved modules. The head is the model's, not the adapter's: loading an
adapter with a saved head replaces the head's weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..convert.tasks import head_modules
from .peft_names import name_map, name_maps

#: peft's prefix of every saved tensor (as ``models.checkpoints.peft_lora`` writes the LoRA weights).
PEFT_PREFIX = "base_model.model."
#: peft's task types of the task heads (peft picks its model wrapper by it).
TASK_TYPES = {"sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
              "question_answering": "QUESTION_ANS"}


def head_names(model: nn.Module, family: str | None) -> dict[str, str]:
    """``transformers`` module -> zoo module of the model's head in ``family`` (the zoo's names for ``None``).

    Args:
        model: the model with a task head.
        family: the ``transformers`` family (``model_type``), or None.

    Returns:
        ``transformers`` module name -> zoo module name (``head...``).

    Raises:
        ValueError: the family has no task class for the head.
    """
    if family is None:
        return {"head": "head"}
    return {hf: f"head.{zoo}" for hf, zoo in head_modules(model, family).items()}


def head_state(model: nn.Module) -> dict[str, Tensor]:
    """The head's own tensors under zoo names (``head.classifier.weight``), adapters left out.

    Args:
        model: the model with a task head.

    Returns:
        Zoo name -> tensor.

    Shapes: each tensor as the head's parameter of that name.
    """
    return {f"head.{k}": v for k, v in model.head.state_dict().items() if ".adapters." not in f".{k}"}


def trains_head(model: nn.Module) -> bool:
    """Whether the model has a task head with a trainable parameter (saved with the adapter).

    Args:
        model: the model.

    Returns:
        True when its head is a task head (``TASK_TYPES``) with a parameter that requires grad.
    """
    head = getattr(model, "head", None)
    return getattr(model.config, "head", None) in TASK_TYPES and isinstance(head, nn.Module) and any(
        p.requires_grad for p in head.parameters())


def rename(key: str, modules: Mapping[str, str]) -> str | None:
    """``key`` with its longest module prefix of ``modules`` replaced by the mapped module; None when none fits.

    Args:
        key: a tensor name.
        modules: module name -> module name to put in its place.

    Returns:
        The renamed key, or None.
    """
    module = max((m for m in modules if key.startswith(m + ".")), key=len, default=None)
    return None if module is None else modules[module] + key[len(module):]


def with_saved_head(
    model: nn.Module, config: dict[str, Any], tensors: dict[str, Tensor], model_type: str | None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The adapter's ``peft`` config and tensors with the trainable task head added as ``modules_to_save`` (unchanged
    when the head is frozen).

    Args:
        model: the adapted model.
        config: the adapter's ``peft`` config.
        tensors: the adapter's tensors under ``peft`` names.
        model_type: the ``transformers`` family to name the head's modules in (None: the model's own).

    Returns:
        ``(config, tensors)``, with ``modules_to_save`` and ``task_type`` set and the head's tensors added.

    Shapes: each tensor as stored; the head's as its parameters.

    Raises:
        ValueError: a head parameter the task class has no module for, or a LoRA on the head itself (``peft`` saves
            a module whole or adapts it, not both).
    """
    if not trains_head(model):
        return config, tensors
    adapted = sorted(k for k in model.head.state_dict() if ".adapters." in f".{k}")
    if adapted:
        raise ValueError(f"the task head is trained and saved whole, but the adapter also adapts it ({adapted[:2]} "
                         "...); adapt the encoder or decoder layers only (target_modules) or freeze the head")
    family = name_map(model, model_type).family
    names = head_names(model, family)
    to_hf = {zoo: hf for hf, zoo in names.items()}
    out = dict(tensors)
    for key, value in head_state(model).items():
        hf = rename(key, to_hf)
        if hf is None:
            raise ValueError(f"the head's {key!r} has no module in the transformers {family!r} task class")
        out[PEFT_PREFIX + hf] = value.detach().cpu().contiguous()
    task_type = TASK_TYPES[model.config.head] if family is not None else config.get("task_type")
    return {**config, "modules_to_save": sorted(names), "task_type": task_type}, out


def split_saved_head(
    model: nn.Module, config: Mapping[str, Any], tensors: Mapping[str, Tensor], source: str, model_type: str | None
) -> tuple[dict[str, Any], dict[str, Tensor], dict[str, Tensor]]:
    """``(config without modules_to_save, the LoRA tensors, the saved head's tensors under zoo names)``.

    The saved tensors are read as the head modules of ``model_type`` or of the first family that represents the
    model and has them all.

    Args:
        model: the model the adapter loads into.
        config: the adapter's ``peft`` config.
        tensors: the adapter file's tensors.
        source: names the adapter in messages.
        model_type: the ``transformers`` family the head's modules are named in (None: try each).

    Returns:
        The three parts; no head tensors when the adapter saves no modules.

    Raises:
        ValueError: ``modules_to_save`` that is not a list of names; saved modules on a model without a task head;
            saved tensors that are not the head's (named), of other shapes, or not finite floating point.

    Shapes: each tensor as the head's parameter of that name.
    """
    saved = config.get("modules_to_save")
    lora = {k: v for k, v in tensors.items() if not saved or k.endswith((".lora_A.weight", ".lora_B.weight"))}
    if not saved:
        return dict(config), dict(tensors), {}
    where = f"{source}: adapter_config.json"
    if not isinstance(saved, list) or not all(isinstance(s, str) and s for s in saved):
        raise ValueError(f"{where} has modules_to_save={saved!r}; expected null or a list of module names")
    head = getattr(model.config, "head", None)
    rest = {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items() if k not in lora}
    if head not in TASK_TYPES:
        raise ValueError(
            f"{where} sets modules_to_save={saved!r}, which transformer-zoo does not implement for this "
            f"{type(model).__name__} with the {head!r} head: saved modules load into a task head (load the base "
            "model with one, e.g. from_pretrained(path, head='sequence_classification'))"
        )
    expected = head_state(model)
    families = [model_type] if model_type is not None else list(name_maps(model))
    unknown: list[str] = sorted(rest)
    for family in families:
        try:
            names = head_names(model, family)
        except ValueError:
            continue
        state = {rename(k, names): v for k, v in rest.items()}
        unknown = sorted(k for k in rest if rename(k, names) not in expected)
        if unknown:
            continue
        for key, value in state.items():
            if not isinstance(value, Tensor) or not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                raise ValueError(f"{source}: the saved {key!r} is not a finite floating-point tensor")
            if tuple(value.shape) != tuple(expected[key].shape):
                raise ValueError(f"{source}: the saved {key!r} has shape {tuple(value.shape)}, but this model's head "
                                 f"has {tuple(expected[key].shape)}: a head for other labels or sizes")
        return {**config, "modules_to_save": None}, lora, state
    raise ValueError(
        f"{source}: the adapter saves {unknown[:4]}, which are not modules of this {type(model).__name__}'s "
        f"{head!r} head; only the task head can be a saved module"
    )


def load_saved_head(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy the saved head tensors (zoo names) into ``model.head`` and make the head trainable.

    Args:
        model: the model.
        state: the saved head tensors (``split_saved_head``); nothing is done when empty.

    Shapes: each tensor as the head's parameter of that name.
    """
    if not state:
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in state.items():
            params[key].copy_(value)
    model.head.requires_grad_(True)
