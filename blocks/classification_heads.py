"""The classification heads (registered kind ``head``): one label per sequence, one per token, or an answer span.

They share ``ClassifierHead``: the layers each family puts between its hidden states and the classifier (BERT's
pooler, RoBERTa's dense + tanh, DistilBERT's dense + ReLU, ModernBERT's dense + activation + norm), then dropout and
the classifier. Each computes its loss with ``loss`` as ``transformers`` does for the same problem type (MSE, cross
entropy or BCE with logits; -100 ignored; QA the mean of the start and end cross entropies with out-of-range
positions ignored). ``blocks.heads`` re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .label_checks import check_choice, check_class_ids, check_labels_map, check_shape, check_tensor
from .pooling import POOLINGS, pool
from .registry import register

#: the losses of ``SequenceClassificationHead``, named as ``transformers`` names its ``problem_type``.
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


#: the layers between the pooled state and the classifier, as each family has them.
PRE_CLASSIFIERS = ("none", "bert", "roberta", "distilbert", "modernbert")
#: the activations of the ``modernbert`` pre-classifier (the others fix theirs), by ``transformers``-like name.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": nn.functional.gelu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "silu": nn.functional.silu,
    "tanh": torch.tanh,
}


class ClassifierHead(nn.Module):
    """The layers the families put between hidden states and their labels (shared by the classification heads).

    ``pre_classifier``: ``none``; ``bert`` (dense + tanh: BERT's pooler); ``roberta`` (dropout, dense + tanh:
    RoBERTa's head); ``distilbert`` (dense + ReLU); ``modernbert`` (dense + ``activation`` + norm). Then dropout
    (``classifier_dropout``, default the model's hidden dropout) and the classifier to ``n_out`` outputs.

    Args:
        d_model: the width of the hidden states.
        n_out: the classifier's outputs (labels, or 2 for an answer span's start and end).
        dropout: the model's hidden dropout, used when ``classifier_dropout`` is None.
        classifier_dropout: the dropout before the classifier (and, for ``roberta``, before the dense layer).
        pre_classifier: one of ``PRE_CLASSIFIERS``.
        activation: the ``modernbert`` pre-classifier's activation (one of ``ACTIVATIONS``; the other families
            fix theirs).
        classifier_bias: whether the classifier has a bias.
        make_norm: builds the ``modernbert`` pre-classifier's norm.
        bias: whether the dense layer has a bias.

    Raises:
        ValueError: an unknown ``pre_classifier`` or ``activation``, or ``classifier_dropout`` outside [0, 1).
    """

    def __init__(
        self, d_model: int, n_out: int, *, dropout: float, classifier_dropout: float | None, pre_classifier: str,
        activation: str, classifier_bias: bool, make_norm: Callable[[], nn.Module], bias: bool,
    ) -> None:
        super().__init__()
        check_choice("pre_classifier", pre_classifier, PRE_CLASSIFIERS)
        check_choice("activation", activation, tuple(ACTIVATIONS))
        if classifier_dropout is not None and not 0.0 <= classifier_dropout < 1.0:
            raise ValueError(f"classifier_dropout must be None or in [0, 1), got {classifier_dropout!r}")
        self.pre_classifier = pre_classifier
        self.activation = {"bert": "tanh", "roberta": "tanh", "distilbert": "relu"}.get(pre_classifier, activation)
        if pre_classifier != "none":
            self.dense = nn.Linear(d_model, d_model, bias=bias)
        if pre_classifier == "modernbert":
            self.norm = make_norm()
        self.dropout = nn.Dropout(dropout if classifier_dropout is None else classifier_dropout)
        self.classifier = nn.Linear(d_model, n_out, bias=classifier_bias)

    def classify(self, x: Tensor) -> Tensor:
        """The classifier's outputs for hidden states: the pre-classifier layers, dropout, then the classifier.

        Args:
            x: pooled or per-token hidden states.

        Returns:
            The logits.

        Shapes: x ``(..., d_model)`` -> ``(..., n_out)``.
        """
        if self.pre_classifier == "roberta":
            x = self.dropout(x)
        if self.pre_classifier != "none":
            x = ACTIVATIONS[self.activation](self.dense(x))
        if self.pre_classifier == "modernbert":
            x = self.norm(x)
        return self.classifier(self.dropout(x))


@register("head", "sequence_classification")
class SequenceClassificationHead(ClassifierHead):
    """One label (or score) per sequence from a pooled state (``pooling``: the first token for the BERT family,
    the last real token for decoders).

    ``problem_type`` None chooses as ``transformers`` does: ``num_labels == 1`` regression, integer labels
    single-label classification, float labels multi-label classification.

    Args:
        d_model: the width of the hidden states.
        make_norm: builds the ``modernbert`` pre-classifier's norm (supplied by the model).
        bias: whether the pre-classifier's dense layer has a bias (supplied by the model).
        dropout: the model's hidden dropout (supplied), used when ``classifier_dropout`` is None.
        num_labels: the number of labels (>= 1).
        id2label: label names by id (``"0"`` .. ``str(num_labels - 1)``), or None.
        label2id: the inverse map, or None.
        problem_type: one of ``PROBLEM_TYPES``, or None to choose from the labels (``resolved_problem_type``).
        classifier_dropout: the dropout before the classifier.
        pre_classifier: the family's layers before the classifier (one of ``PRE_CLASSIFIERS``).
        activation: the ``modernbert`` pre-classifier's activation (one of ``ACTIVATIONS``).
        classifier_bias: whether the classifier has a bias.
        pooling: how the sequence becomes one vector (one of ``blocks.pooling.POOLINGS``).

    Raises:
        ValueError: a bad ``num_labels`` or label map, an unknown ``problem_type``, ``pooling``, ``pre_classifier``
            or ``activation``, or ``classifier_dropout`` outside [0, 1).

    Shapes: ``(B, L, d_model)``, mask ``(B, L)`` -> ``(B, num_labels)``.
    """

    def __init__(
        self, d_model: int, make_norm: Callable[[], nn.Module], bias: bool = True, dropout: float = 0.1, *,
        num_labels: int = 2, id2label: dict[str, str] | None = None, label2id: dict[str, int] | None = None,
        problem_type: str | None = None, classifier_dropout: float | None = None, pooling: str = "cls",
        pre_classifier: str = "none", activation: str = "gelu", classifier_bias: bool = True,
    ) -> None:
        check_labels_map(num_labels, id2label, label2id)
        if problem_type is not None:
            check_choice("problem_type", problem_type, PROBLEM_TYPES)
        check_choice("pooling", pooling, POOLINGS)
        super().__init__(
            d_model, num_labels, dropout=dropout, classifier_dropout=classifier_dropout, pre_classifier=pre_classifier,
            activation=activation, classifier_bias=classifier_bias, make_norm=make_norm, bias=bias,
        )
        self.num_labels, self.problem_type, self.pooling = num_labels, problem_type, pooling

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.classify(pool(x, mask, self.pooling))

    def resolved_problem_type(self, labels: Tensor) -> str:
        """The problem type ``transformers`` would pick for these labels: the configured one, else regression for
        one label, single-label classification for integer labels and multi-label classification for float ones.

        Args:
            labels: the labels ``loss`` is given.

        Returns:
            One of ``PROBLEM_TYPES``.

        Shapes: labels: any (only the dtype is read).
        """
        if self.problem_type is not None:
            return self.problem_type
        if self.num_labels == 1:
            return "regression"
        if labels.dtype in (torch.long, torch.int):
            return "single_label_classification"
        return "multi_label_classification"

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """MSE, cross entropy (-100 ignored) or BCE with logits, by problem type.

        Args:
            logits: the head's output.
            labels: float scores (regression), integer class ids or -100 (single-label), or float 0/1 targets per
                label (multi-label).

        Returns:
            The scalar loss, in float32.

        Shapes: logits ``(B, num_labels)``; labels ``(B,)`` or ``(B, 1)`` (regression with one label, single-label)
        or ``(B, num_labels)`` -> ``()``.

        Raises:
            ValueError: labels of the wrong dtype, shape or range for the problem type (named).
        """
        check_tensor(labels, "labels")
        b, n = logits.shape
        kind = self.resolved_problem_type(labels)
        if kind == "regression":
            if not labels.dtype.is_floating_point:
                raise ValueError(f"regression labels must be floating point, got dtype {labels.dtype}")
            shapes = [(b,), (b, 1)] if n == 1 else [(b, n)]
            check_shape(labels, shapes, kind)
            if n == 1:
                return nn.functional.mse_loss(logits.squeeze().float(), labels.squeeze().float())
            return nn.functional.mse_loss(logits.float(), labels.float())
        if kind == "single_label_classification":
            if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
                raise ValueError(f"single-label classification labels must be integer class ids, got {labels.dtype}")
            check_shape(labels, [(b,), (b, 1)], kind)
            check_class_ids(labels, n)
            return nn.functional.cross_entropy(logits.view(-1, n).float(), labels.reshape(-1), ignore_index=-100)
        if not labels.dtype.is_floating_point:
            raise ValueError(f"multi-label classification labels must be floating 0/1 targets, got {labels.dtype}")
        check_shape(labels, [(b, n)], kind)
        if labels.numel() and not bool(((labels >= 0) & (labels <= 1)).all()):
            raise ValueError(f"multi-label classification labels must lie in [0, 1], got values in "
                             f"[{float(labels.min())}, {float(labels.max())}]")
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float())


@register("head", "token_classification")
class TokenClassificationHead(ClassifierHead):
    """One label per token (NER, POS tagging); the loss ignores positions labelled -100.

    Args:
        d_model: the width of the hidden states.
        make_norm: builds the ``modernbert`` pre-classifier's norm (supplied by the model).
        bias: whether the pre-classifier's dense layer has a bias (supplied by the model).
        dropout: the model's hidden dropout (supplied), used when ``classifier_dropout`` is None.
        num_labels: the number of labels (>= 1).
        id2label: label names by id (``"0"`` .. ``str(num_labels - 1)``), or None.
        label2id: the inverse map, or None.
        classifier_dropout: the dropout before the classifier.
        pre_classifier: the family's layers before the classifier (one of ``PRE_CLASSIFIERS``).
        activation: the ``modernbert`` pre-classifier's activation (one of ``ACTIVATIONS``).
        classifier_bias: whether the classifier has a bias.

    Raises:
        ValueError: a bad ``num_labels`` or label map, an unknown ``pre_classifier`` or ``activation``, or
            ``classifier_dropout`` outside [0, 1).

    Shapes: ``(B, L, d_model)`` -> ``(B, L, num_labels)``.
    """

    def __init__(
        self, d_model: int, make_norm: Callable[[], nn.Module], bias: bool = True, dropout: float = 0.1, *,
        num_labels: int = 2, id2label: dict[str, str] | None = None, label2id: dict[str, int] | None = None,
        classifier_dropout: float | None = None, pre_classifier: str = "none", activation: str = "gelu",
        classifier_bias: bool = True,
    ) -> None:
        check_labels_map(num_labels, id2label, label2id)
        super().__init__(
            d_model, num_labels, dropout=dropout, classifier_dropout=classifier_dropout, pre_classifier=pre_classifier,
            activation=activation, classifier_bias=classifier_bias, make_norm=make_norm, bias=bias,
        )
        self.num_labels = num_labels

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.classify(x)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Mean cross entropy over the labelled tokens.

        Args:
            logits: the head's output.
            labels: a class id per token, -100 where a token has none (padding, sub-word continuations).

        Returns:
            The scalar loss, in float32.

        Shapes: logits ``(B, L, num_labels)``, labels ``(B, L)`` long -> ``()``.

        Raises:
            ValueError: labels that are not integer ``(B, L)`` ids in ``[0, num_labels)`` or -100.
        """
        check_tensor(labels, "labels")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
            raise ValueError(f"token classification labels must be integer class ids (or -100), got {labels.dtype}")
        check_shape(labels, [tuple(logits.shape[:2])], "token classification")
        check_class_ids(labels, self.num_labels)
        n = self.num_labels
        return nn.functional.cross_entropy(logits.reshape(-1, n).float(), labels.reshape(-1), ignore_index=-100)


@register("head", "question_answering")
class QuestionAnsweringHead(ClassifierHead):
    """Start and end logits of an answer span (extractive QA).

    Args:
        d_model: the width of the hidden states.
        make_norm: builds the ``modernbert`` pre-classifier's norm (supplied by the model).
        bias: whether the pre-classifier's dense layer has a bias (supplied by the model).
        dropout: the model's hidden dropout (supplied), used when ``classifier_dropout`` is None.
        classifier_dropout: the dropout before the classifier (0 by default, as BERT's QA head).
        pre_classifier: the family's layers before the classifier (one of ``PRE_CLASSIFIERS``).
        activation: the ``modernbert`` pre-classifier's activation (one of ``ACTIVATIONS``).
        classifier_bias: whether the classifier has a bias.

    Raises:
        ValueError: an unknown ``pre_classifier`` or ``activation``, or ``classifier_dropout`` outside [0, 1).

    Shapes: ``(B, L, d_model)`` -> ``(B, L, 2)`` (start, end).
    """

    def __init__(
        self, d_model: int, make_norm: Callable[[], nn.Module], bias: bool = True, dropout: float = 0.1, *,
        classifier_dropout: float | None = 0.0, pre_classifier: str = "none", activation: str = "gelu",
        classifier_bias: bool = True,
    ) -> None:
        super().__init__(
            d_model, 2, dropout=dropout, classifier_dropout=classifier_dropout, pre_classifier=pre_classifier,
            activation=activation, classifier_bias=classifier_bias, make_norm=make_norm, bias=bias,
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.classify(x)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The mean of the start and end cross entropies; as ``transformers``, positions are clamped to
        ``[0, L]`` and ``L`` (beyond the sequence) is ignored.

        Args:
            logits: the head's output, start logits then end logits on the last axis.
            labels: integer ``(start, end)`` token positions of each answer.

        Returns:
            The scalar loss, in float32.

        Raises:
            ValueError: labels that are not an integer ``(B, 2)`` tensor.

        Shapes: logits ``(B, L, 2)``, labels ``(B, 2)`` long -> ``()``.
        """
        check_tensor(labels, "labels")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
            raise ValueError(f"question answering labels must be integer (start, end) positions, got {labels.dtype}")
        check_shape(labels, [(logits.shape[0], 2)], "question answering (start, end)")
        length = logits.shape[1]
        positions = labels.clamp(0, length)
        start = nn.functional.cross_entropy(logits[..., 0].float(), positions[:, 0], ignore_index=length)
        end = nn.functional.cross_entropy(logits[..., 1].float(), positions[:, 1], ignore_index=length)
        return (start + end) / 2
