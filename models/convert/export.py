"""Write zoo models in ``transformers`` format: the inverse of ``from_transformers``.

``to_transformers(model)`` returns a ``config.json`` dict and a state dict under ``transformers`` names;
``save_transformers(model, directory)`` writes them so that ``transformers``' ``from_pretrained`` loads
the folder. Exporters register by ``model_type`` with ``@register_exporter("gpt2")`` (kind ``hf_exporter``
of the ``blocks`` registry), next to the converter of the same family. A model that a family cannot
represent exactly raises ``NotExportable`` (a ``ValueError``) naming the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor, nn

import blocks
from blocks.adapters import check_exportable
from blocks.heads import LM_HEADS
from blocks.quantized import check_unquantized

from ..core.finite import check_finite

EXPORTER_KIND = "hf_exporter"
#: kind of ``models.convert.tasks.export_task`` (models with a task head), looked up so this module imports it not.
TASK_EXPORT_KIND = "hf_task_export"
#: kind of ``models.checkpoints.atomic.write_folder`` (name ``"atomic"``), looked up as the package sits above this one.
FOLDER_WRITER_KIND = "folder_writer"

Exporter = Callable[[nn.Module], tuple[dict[str, Any], dict[str, Tensor]]]

# zoo FFN registry name -> transformers activation name.
ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


class NotExportable(ValueError):
    """A zoo model that a ``transformers`` family cannot represent exactly."""


def register_exporter(model_type: str) -> Callable[[Exporter], Exporter]:
    """Decorator registering an exporter to ``transformers``' ``model_type``.

    Args:
        model_type: the ``transformers`` family the exporter writes.

    Returns:
        The decorator; it returns the exporter unchanged.

    Raises:
        ValueError: if ``model_type`` already has an exporter.
    """
    return blocks.register(EXPORTER_KIND, model_type)


def to_transformers(model: nn.Module, model_type: str | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``transformers`` config dict and state dict that compute what ``model`` computes.

    Args:
        model: a zoo model.
        model_type: the ``transformers`` family to write (default: the family the model was converted from, else
            the first registered family that can represent the model exactly).

    Returns:
        ``(config dict with "model_type" and "architectures", state dict)``; tensors are detached,
        contiguous and never share memory, and tied copies are left out as ``transformers`` saves them.

    Raises:
        ValueError: an unknown ``model_type``, or a model no (or not the named) family represents exactly;
            the message gives each family's reason.

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    check_exportable(model, "export to transformers", allow_merged=True)
    check_unquantized(model, "export to transformers")
    config = getattr(model, "config", None)
    head = getattr(config, "head", None)
    # A task head of a model class that also has a language-model head (models.convert.tasks.export_task); a class
    # with only task heads (ViT's image classifier) is its family's own export.
    if isinstance(head, str) and head not in LM_HEADS and any(h in LM_HEADS for h in getattr(config, "heads", ())):
        return _unshared(blocks.get(TASK_EXPORT_KIND, "export")(model, model_type))
    if model_type is not None:
        exporter = blocks.get(EXPORTER_KIND, model_type)
        try:
            return _unshared(exporter(model))
        except NotExportable as err:
            raise NotExportable(f"this {type(model).__name__} cannot be written as {model_type!r}: {err}") from err
    reasons = []
    for name in families_to_try(model):
        try:
            return _unshared(blocks.get(EXPORTER_KIND, name)(model))
        except NotExportable as err:
            reasons.append(f"{name}: {err}")
    raise ValueError(f"no transformers family represents this {type(model).__name__} exactly ({'; '.join(reasons)})")


def save_transformers(model: nn.Module, directory: str | os.PathLike[str], model_type: str | None = None, *,
                      tokenizer: Any = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` that ``transformers`` loads as ``model``'s equivalent.

    The folder is written atomically, even if the process is killed (``models.checkpoints.atomic.write_folder``):
    a reader sees the old files or the new ones, never a mix; other files already in the folder are kept.

    Args:
        model: a zoo model of a family ``models.convert`` exports.
        directory: the folder to write.
        model_type: the ``transformers`` family to write (default: the first registered one that represents the
            model exactly).
        tokenizer: a ``tokenization.Tokenizer`` written with the model, in the same atomic save (default: none).

    Returns:
        The folder's path.

    Raises:
        ValueError: as ``to_transformers``, or a tensor holding NaN or inf (named); nothing is written then.
        NotADirectoryError: ``directory`` exists and is not a folder (nothing is written).
        OSError: writing failed (a full disk, ...); the message says whether the folder is unchanged.
    """
    config, state_dict = to_transformers(model, model_type)
    check_finite(state_dict, "export to transformers")
    path = Path(directory)

    def write(folder: Path) -> None:
        save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save(folder / "tokenizer.json")

    blocks.get(FOLDER_WRITER_KIND, "atomic")(path, write, what="a transformers export")
    return path


def families_to_try(model: nn.Module) -> list[str]:
    """The registered exporters in the order an export tries them: the family the model was converted from
    (``model.transformers_model_type``) first, so a RoBERTa stays a RoBERTa, then every other one.

    Args:
        model: the model to export.

    Returns:
        Exporter names, in order.
    """
    names = blocks.names(EXPORTER_KIND)
    source = getattr(model, "transformers_model_type", None)
    if isinstance(source, str) and source not in names:
        source = source.removesuffix("_text")  # gemma3_text: the text model of the gemma3 family
    return [source, *(n for n in names if n != source)] if source in names else names


def require(condition: bool, reason: str) -> None:
    """Raise ``NotExportable(reason)`` unless ``condition``.

    Args:
        condition: what the family needs of the model.
        reason: what the model has instead (the error's message).

    Raises:
        NotExportable: ``condition`` is false.
    """
    if not condition:
        raise NotExportable(reason)


def require_plain_attention(config: Any) -> None:
    """Multi-head attention with ``n_heads · d_head = d_model`` and as many key/value heads as query heads.

    Also biases on every projection and LayerNorm.

    Args:
        config: the zoo model's config.

    Raises:
        NotExportable: the config has another attention, head layout, norm, or no biases.
    """
    require(config.attention == "mha", f"attention={config.attention!r} (only 'mha')")
    require(config.n_kv_heads == config.n_heads, f"n_kv_heads={config.n_kv_heads} != n_heads={config.n_heads}")
    require(
        config.d_head * config.n_heads == config.d_model and config.d_value == config.d_head,
        f"d_head={config.d_head}, d_value={config.d_value} (must be d_model / n_heads = "
        f"{config.d_model / config.n_heads:g})",
    )
    require(config.bias, "bias=False (the family has biases on every projection)")
    require(config.norm == "layernorm", f"norm={config.norm!r} (only 'layernorm')")


def activation_name(config: Any, allowed: tuple[str, ...] = tuple(ACTIVATION_NAMES)) -> str:
    """The ``transformers`` activation name of the zoo config's FFN.

    Args:
        config: the zoo model's config.
        allowed: the zoo FFNs the family has an activation for.

    Returns:
        The ``transformers`` activation name.

    Raises:
        NotExportable: the config's FFN is not one of ``allowed``.
    """
    require(config.ffn in allowed, f"ffn={config.ffn!r} (one of {list(allowed)})")
    return ACTIVATION_NAMES[config.ffn]


def tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict, detached, without adapter tensors (a merged adapter is already in the weights).

    Args:
        model: the zoo model.

    Returns:
        Zoo name -> tensor.

    Shapes: each tensor as the model holds it.
    """
    return {k: v.detach() for k, v in model.state_dict().items() if ".adapters." not in k}


def _unshared(result: tuple[dict[str, Any], dict[str, Tensor]]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    config, state_dict = result
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, t in state_dict.items():
        t = t.detach().contiguous()
        if t.device.type == "meta":  # a stand-in (models.gguf.export's packed layers): it has no memory to share
            out[key] = t
            continue
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()  # safetensors refuses tensors that share memory
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return config, out
