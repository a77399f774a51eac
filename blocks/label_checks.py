"""Checks of the options and labels a task head takes, raised before any computation with the bad value named.

The heads (``blocks.heads``, ``blocks.classification_heads``) call them in their constructors and losses: a label
outside the classes, of the wrong dtype or shape, or a label map that does not match ``num_labels``, is a
``ValueError`` naming it rather than an index error deep inside ``cross_entropy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``.

    Args:
        name: the option's name (for the message).
        value: its value.
        choices: the values it may take.

    Raises:
        ValueError: ``value`` is not one of ``choices`` (both are named).
    """
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {list(choices)}")


def check_labels_map(num_labels: int, id2label: Mapping[Any, str] | None, label2id: Mapping[str, Any] | None) -> None:
    """Check ``num_labels`` > 0 and that ``id2label`` / ``label2id`` name exactly the ids ``0 .. num_labels-1``.

    Args:
        num_labels: the number of labels.
        id2label: label names by id, or None.
        label2id: ids by label name, or None.

    Raises:
        ValueError: naming the bad value and what was expected.
    """
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(f"num_labels must be a positive integer, got {num_labels!r}")
    for name, labels in (("id2label", id2label), ("label2id", label2id)):  # sizes first: nothing built from them
        if labels is not None and len(labels) != num_labels:
            verb = "has ids for" if name == "id2label" else "maps to ids for"
            raise ValueError(f"{name} {verb} {len(labels)} labels, which do not match num_labels={num_labels}")
    if id2label is None and label2id is None:
        return
    expected = [str(i) for i in range(num_labels)]  # as long as a map given: bounded by what was read
    if id2label is not None and sorted(map(str, id2label), key=lambda k: (len(k), k)) != expected:
        raise ValueError(
            f"id2label has ids {sorted(map(str, id2label))}, which do not match num_labels={num_labels} "
            f"(expected the ids {expected})"
        )
    if label2id is not None:
        ids = sorted(str(v) for v in label2id.values())
        if sorted(ids, key=lambda k: (len(k), k)) != expected:
            raise ValueError(f"label2id maps to ids {ids}, which do not match num_labels={num_labels}")
        if id2label is not None and any(str(label2id.get(label)) != str(i) for i, label in id2label.items()):
            raise ValueError(f"label2id {dict(label2id)} is not the inverse of id2label {dict(id2label)}")


def check_tensor(labels: Any, name: str) -> None:
    """Raise ``ValueError`` unless ``labels`` is a tensor (a list of labels would fail later, less clearly).

    Args:
        labels: what the caller passed.
        name: the argument's name (for the message).

    Raises:
        ValueError: ``labels`` is not a ``torch.Tensor`` (its type is named).
    """
    if not isinstance(labels, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(labels).__name__}")


def check_shape(labels: Tensor, shapes: list[tuple[int, ...]], what: str) -> None:
    """Raise ``ValueError`` unless ``labels`` has one of ``shapes``.

    Args:
        labels: the labels.
        shapes: the shapes accepted.
        what: the problem type (for the message: ``"single_label_classification"``).

    Raises:
        ValueError: another shape (the accepted ones and the one given are named).

    Shapes: labels: any, checked against ``shapes``.
    """
    if tuple(labels.shape) not in [tuple(s) for s in shapes]:
        raise ValueError(f"{what} labels must have shape {' or '.join(map(str, shapes))}, got {tuple(labels.shape)}")


def check_class_ids(labels: Tensor, num_labels: int) -> None:
    """Raise ``ValueError`` unless every label is -100 or a class id in ``[0, num_labels)``.

    Skipped while ``torch.compile`` traces (reading a value would break the graph): the eager call checks.

    Args:
        labels: integer class ids.
        num_labels: the number of classes.

    Raises:
        ValueError: a label outside ``[0, num_labels)`` that is not -100 (the first one is named).

    Shapes: labels: any shape, integer.
    """
    if torch.compiler.is_compiling() or not labels.numel():
        return
    outside = (labels != -100) & ((labels < 0) | (labels >= num_labels))
    if bool(outside.any()):
        raise ValueError(f"labels contain {int(labels[outside][0])}, outside [0, num_labels={num_labels}) and not -100")
