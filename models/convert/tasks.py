"""``transformers`` task classes (``BertForSequenceClassification``, ``LlamaForQuestionAnswering`` ...) <-> a zoo
model class with a task head.

A family declares its task classes with ``register_tasks(TaskLayout(...))``: for each class, the zoo head it becomes,
the base-model prefix the class stores its encoder or decoder under, which of its modules are the head's, and how the
head's options are read from and written to ``config.json``. The converter registry (``from_transformers``) and the
exporter (``to_transformers``) look the layouts up in the ``blocks`` registry (kinds ``hf_task`` and
``hf_task_export``), so they import no family and not this module: a task checkpoint's head tensors are split off,
the rest goes through the family's own converter as a base model, and the head is attached; an export runs the
family's exporter on the model's base and writes the head under the class's names.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn

import blocks
from blocks.heads import LM_HEADS

from ..core.meta_build import meta_build
from .export import EXPORTER_KIND, TASK_EXPORT_KIND, NotExportable, families_to_try, require, tensors
from .registry import CONVERTER_KIND, TASK_CONVERT_KIND, Converted

TASK_KIND = "hf_task"

Fields = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class TaskClass:
    """One ``transformers`` task class of a family.

    Attributes:
        architecture: the class name (``"BertForSequenceClassification"``).
        head: the zoo head it becomes.
        prefix: where the class stores its base model (``"bert."``, ``"transformer."``).
        names: ``transformers`` head module -> zoo head module (``{"bert.pooler.dense": "dense"}``).
        options: the zoo head's options from the checkpoint's ``config.json`` (labels added by the layout).
        fields: the ``config.json`` fields of the head's options (labels added by the layout).
        requires: head options an export needs (``{"pre_classifier": "bert"}``): a model with others is another class.
    """

    architecture: str
    head: str
    prefix: str
    names: Mapping[str, str]
    options: Callable[[Fields], dict[str, Any]] = lambda cfg: {}
    fields: Callable[[Fields, Any], dict[str, Any]] = lambda options, config: {}
    requires: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TaskLayout:
    """A family's task classes.

    Attributes:
        model_type: the family's ``transformers`` ``model_type``.
        base_prefix: the prefix its own converter and exporter use for the base model (``"bert."`` of
            ``BertForMaskedLM``, ``"model."`` of ``LlamaForCausalLM``).
        classes: its task classes.
    """

    model_type: str
    base_prefix: str
    classes: tuple[TaskClass, ...]

    def find(self, architecture: str | None) -> TaskClass | None:
        """The task class named ``architecture``.

        Args:
            architecture: a class name from ``config.json``'s ``architectures``, or None.

        Returns:
            The task class, or None when the family has none of that name.
        """
        return next((t for t in self.classes if t.architecture == architecture), None)


def register_tasks(layout: TaskLayout) -> TaskLayout:
    """Register a family's task classes for conversion both ways (by its ``model_type``).

    Args:
        layout: the family's task classes.

    Returns:
        ``layout`` itself.
    """
    blocks.register(TASK_KIND, layout.model_type)(layout)
    return layout


def label_options(cfg: Fields, head: str) -> dict[str, Any]:
    """``num_labels``, ``id2label``, ``label2id`` and ``problem_type`` of a ``transformers`` config (QA: none).

    Args:
        cfg: the ``config.json`` dict.
        head: the zoo head.

    Returns:
        The head's label options (empty for question answering and embedding heads).
    """
    if head in ("question_answering", "embedding"):
        return {}
    id2label = cfg.get("id2label")
    num_labels = len(id2label) if isinstance(id2label, Mapping) else cfg.get("num_labels", 2)
    options: dict[str, Any] = {"num_labels": num_labels}
    if isinstance(id2label, Mapping):
        options["id2label"] = {str(k): v for k, v in id2label.items()}
    if isinstance(cfg.get("label2id"), Mapping):
        options["label2id"] = {k: int(v) for k, v in cfg["label2id"].items()}
    if head == "sequence_classification" and cfg.get("problem_type") is not None:
        options["problem_type"] = cfg["problem_type"]
    return options


def label_fields(options: Fields, head: str) -> dict[str, Any]:
    """The inverse of ``label_options``: ``id2label``/``label2id`` (default names), ``problem_type``.

    Args:
        options: the head's options.
        head: the zoo head.

    Returns:
        The ``config.json`` fields.
    """
    n = 2 if head == "question_answering" else options.get("num_labels", 2)
    id2label = options.get("id2label") or {str(i): f"LABEL_{i}" for i in range(n)}
    label2id = options.get("label2id") or {v: int(k) for k, v in id2label.items()}
    fields = {"id2label": dict(id2label), "label2id": dict(label2id)}
    if head == "sequence_classification":
        fields["problem_type"] = options.get("problem_type")
    return fields


@blocks.register(TASK_CONVERT_KIND, "convert")
def convert_task(hf_config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> Converted | None:
    """Convert a task-class checkpoint of a registered family, or None when it is no registered task class.

    Args:
        hf_config: the checkpoint's ``config.json``.
        state_dict: its tensors under ``transformers`` names.

    Returns:
        The zoo architecture, config and state dict (``Converted``), or None for a checkpoint of no registered task
        class.

    Shapes: each tensor keeps its elements; fused or transposed ones are split or transposed to the zoo's layout.
    """
    model_type = hf_config.get("model_type")
    if TASK_KIND not in blocks.kinds() or model_type not in blocks.names(TASK_KIND):
        return None
    layout: TaskLayout = blocks.get(TASK_KIND, model_type)
    architectures = hf_config.get("architectures") or [None]
    task = layout.find(architectures[0] if isinstance(architectures, list) else None)
    if task is None:
        if not state_dict or any(k.startswith(layout.base_prefix) for k in state_dict):
            return None
        # A base-model checkpoint (LlamaModel, as a sentence-transformers folder holds it), read under the family's
        # prefix. Where the family's converter takes a missing LM head (left to initialise, with a warning), it is
        # missing; otherwise the head is tied to the embedding, and the warning says so.
        convert = blocks.get(CONVERTER_KIND, model_type)
        prefixed = {layout.base_prefix + k: v for k, v in state_dict.items()}
        try:
            return convert(dict(hf_config), prefixed)
        except ValueError:
            if hf_config.get("tie_word_embeddings") is True:
                raise
        warnings.warn(f"{model_type} base-model checkpoint has no LM head: the zoo model's head is tied to the "
                      "token embedding", stacklevel=2)
        return convert({**hf_config, "tie_word_embeddings": True}, prefixed)
    by_length = sorted(task.names.items(), key=lambda item: -len(item[0]))
    head_state: dict[str, Tensor] = {}
    base_state: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        module = next((hf for hf, _ in by_length if key.startswith(hf + ".")), None)
        if module is not None:
            head_state[f"head.{task.names[module]}{key[len(module):]}"] = value
        else:
            name = key[len(task.prefix):] if task.prefix and key.startswith(task.prefix) else key
            base_state[layout.base_prefix + name] = value
    # Converted as its family's base model; "tied" so that no LM head is asked for.
    base_config = {**hf_config, "architectures": [], "tie_word_embeddings": True}
    converted = blocks.get(CONVERTER_KIND, model_type)(base_config, base_state)
    options = {**task.options(hf_config), **label_options(hf_config, task.head)}
    config = converted.config
    tie = hf_config.get("tie_word_embeddings")
    config = config.replace(
        head=task.head, options={**config.options, "head": options},
        tie_embeddings=config.tie_embeddings if not isinstance(tie, bool) else tie,
    )
    lm = ("mlm_head.", "lm_head.")
    state = {k: v for k, v in converted.state_dict.items() if not k.startswith(lm)}
    state.update(head_state)
    allow = frozenset(k for k in converted.allow_missing if not k.startswith(lm))
    return Converted(converted.architecture, config, state, allow)


@blocks.register(TASK_EXPORT_KIND, "export")
def export_task(model: nn.Module, model_type: str | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``transformers`` task-class config and state dict for a zoo model with a task head.

    The model's base goes through the family's exporter (a copy with the family's LM head on the meta device);
    the head is written under the task class's names.

    Args:
        model: the zoo model with a task head.
        model_type: the family to write (None: each in ``families_to_try`` order).

    Returns:
        ``(config, state_dict)`` of the task class.

    Raises:
        ValueError: no registered family has a task class for this head and its options (each family's reason).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    c = model.config
    lm, own = lm_view(model)
    names = [model_type] if model_type is not None else families_to_try(model)
    reasons = []
    for name in names:
        try:
            return _export_as(name, model, lm, own)
        except NotExportable as err:
            reasons.append(f"{name}: {err}")
    raise NotExportable(
        f"no transformers task class represents this {type(model).__name__} with head {c.head!r} "
        f"({'; '.join(reasons)})"
    )


def lm_view(model: nn.Module) -> tuple[nn.Module, dict[str, Tensor]]:
    """``(the model's base under its class's LM head, built on the meta device, its tensors)``: what the family
    exporters take. The LM head's tensors stay on the meta device.

    Args:
        model: the zoo model with a task head.

    Returns:
        The LM-headed view and the model's own tensors (``tensors(model)``).

    Shapes: each tensor as the model holds it.
    """
    c = model.config
    lm_head = next(h for h in type(c).heads if h in LM_HEADS)
    options = {k: v for k, v in c.options.items() if k != "head"}
    with meta_build():
        lm = type(model)(c.replace(head=lm_head, options=options))  # an untied LM head stays on meta: left out
    own = tensors(model)
    lm.load_state_dict({k: v for k, v in own.items() if not k.startswith("head.")}, strict=False, assign=True)
    return lm, own


def export_base(model: nn.Module, model_type: str | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A ``transformers`` base-model config and state dict (``BertModel``, ``LlamaModel`` ...) of any text model,
    whatever its head: what ``AutoModel`` loads (a sentence-transformers folder's transformer).

    Args:
        model: the zoo text model.
        model_type: the family to write (None: each in ``families_to_try`` order).

    Returns:
        ``(config, state_dict)`` of the base model, without the base prefix.

    Raises:
        ValueError: no registered family represents the model's base (each family's reason).

    Shapes: each tensor in the ``transformers`` layout of its module.
    """
    lm, _ = lm_view(model)
    reasons = []
    for name in [model_type] if model_type is not None else families_to_try(model):
        try:
            require(TASK_KIND in blocks.kinds() and name in blocks.names(TASK_KIND), "no base-model layout")
            layout: TaskLayout = blocks.get(TASK_KIND, name)
            hf_config, lm_state = blocks.get(EXPORTER_KIND, name)(lm)
        except NotExportable as err:
            reasons.append(f"{name}: {err}")
            continue
        state = {k[len(layout.base_prefix):]: v for k, v in lm_state.items()
                 if k.startswith(layout.base_prefix) and not v.is_meta}
        return {**hf_config, "architectures": []}, state
    raise NotExportable(f"no transformers family represents this {type(model).__name__} ({'; '.join(reasons)})")


def task_class(name: str, model: nn.Module) -> tuple[TaskLayout, TaskClass]:
    """The layout of family ``name`` and its task class that represents ``model``'s head and options.

    Args:
        name: the family's ``model_type``.
        model: the zoo model with a task head.

    Returns:
        ``(layout, task class)``.

    Raises:
        NotExportable: the family has no task classes, or none for this head and its options.
    """
    c = model.config
    require(TASK_KIND in blocks.kinds() and name in blocks.names(TASK_KIND), "no task classes registered")
    layout: TaskLayout = blocks.get(TASK_KIND, name)
    head_options = c.block_options("head")
    tasks = [t for t in layout.classes if t.head == c.head]
    require(bool(tasks), f"no {c.head} class")
    fitting = [t for t in tasks if all(
        fits(head_options.get(k, getattr(model.head, k, default_option(c.head, k))), v) for k, v in t.requires.items()
    )]
    require(bool(fitting), f"its {c.head} classes need options {[dict(t.requires) for t in tasks]}")
    return layout, fitting[0]


def head_modules(model: nn.Module, model_type: str) -> dict[str, str]:
    """``transformers`` module -> zoo module of ``model.head`` (``{"bert.pooler.dense": "dense", "classifier":
    "classifier"}``) in the task class that family ``model_type`` writes the model as.

    Args:
        model: the zoo model with a task head.
        model_type: the family.

    Returns:
        ``transformers`` module name -> zoo head module name.

    Raises:
        NotExportable: the family has no task class for this head and its options.
    """
    return dict(task_class(model_type, model)[1].names)


def _export_as(name: str, model: nn.Module, lm: nn.Module, own: Mapping[str, Tensor]) -> tuple[dict, dict]:
    c = model.config
    layout, task = task_class(name, model)
    head_options = c.block_options("head")
    hf_config, lm_state = blocks.get(EXPORTER_KIND, name)(lm)
    state = {
        task.prefix + k[len(layout.base_prefix):]: v for k, v in lm_state.items()
        if k.startswith(layout.base_prefix) and not v.is_meta
    }
    inverse = {zoo: hf for hf, zoo in task.names.items()}
    for key, value in own.items():
        if key.startswith("head."):
            module, param = key[len("head."):].rsplit(".", 1)
            state[f"{inverse[module]}.{param}"] = value
    hf_config = {
        **hf_config, "architectures": [task.architecture], "tie_word_embeddings": c.tie_embeddings,
        **label_fields(head_options, c.head), **task.fields(head_options, c),
    }
    return hf_config, state


def fits(value: Any, required: Any) -> bool:
    """``value`` equals ``required``, or is one of them when ``required`` is a tuple.

    Args:
        value: a head option's value.
        required: the value a task class needs, or a tuple of accepted values.

    Returns:
        Whether it fits.
    """
    return value in required if isinstance(required, tuple) else value == required


def default_option(head: str, option: str) -> Any:
    """A head option's default (the registered head's signature).

    Args:
        head: the registered head.
        option: the option's name.

    Returns:
        Its default, or None when the head takes no such option.
    """
    parameter = inspect.signature(blocks.get("head", head)).parameters.get(option)
    return None if parameter is None else parameter.default


# ------------------------------------------------------------------ the families' common layouts
def dropout_field(name: str) -> Callable[[Fields, Any], dict[str, Any]]:
    """``fields`` writing the head's ``classifier_dropout`` (default: the model's dropout) as ``config.json``'s
    ``name``.

    Args:
        name: the ``config.json`` field.

    Returns:
        A ``TaskClass.fields`` function.
    """
    def fields(options: Fields, config: Any) -> dict[str, Any]:
        value = options.get("classifier_dropout")
        return {name: config.dropout if value is None else value}
    return fields


def decoder_classes(
    prefix: str, qa_prefix: str | None, score: str = "score", token_names: str = "score", stem: str = "",
) -> tuple[TaskClass, ...]:
    """The task classes of a decoder family (``stem`` + ``ForSequenceClassification`` ...): ``score`` on the last
    real token (no bias), a token classifier, and (``qa_prefix`` not None) ``qa_outputs``.

    Args:
        prefix: where the classification classes store the base model.
        qa_prefix: where the question-answering class stores it (None: the family has none).
        score: the sequence classifier's module name.
        token_names: the token classifier's module name.
        stem: the class names' start (``"Llama"``).

    Returns:
        The task classes.
    """
    def token_dropout(cfg: Fields) -> dict[str, Any]:
        for key in ("classifier_dropout", "hidden_dropout"):
            if cfg.get(key) is not None:
                return {"classifier_dropout": float(cfg[key])}
        return {"classifier_dropout": 0.1}

    classes = [
        TaskClass(f"{stem}ForSequenceClassification", "sequence_classification", prefix, {score: "classifier"},
                  lambda cfg: {"pooling": "last", "classifier_bias": False, "classifier_dropout": 0.0},
                  requires={"pooling": "last", "classifier_bias": False, "pre_classifier": "none"}),
        TaskClass(f"{stem}ForTokenClassification", "token_classification", prefix, {token_names: "classifier"},
                  lambda cfg: {**token_dropout(cfg), "classifier_bias": bool(cfg.get("token_classification_bias",
                                                                                     True))},
                  dropout_field("classifier_dropout"), requires={"pre_classifier": "none", "classifier_bias": True}),
    ]
    if qa_prefix is not None:
        classes.append(TaskClass(f"{stem}ForQuestionAnswering", "question_answering", qa_prefix,
                                 {"qa_outputs": "classifier"}, lambda cfg: {"classifier_dropout": 0.0},
                                 requires={"pre_classifier": "none"}))
    return tuple(classes)
