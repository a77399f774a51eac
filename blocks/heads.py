"""Task heads: what a model computes from its final hidden states (registered kind ``head``).

A task is a head: the language-model heads (``lm``: a projection to the vocabulary; ``mlm``: BERT's transform then
the projection), ``sequence_classification``, ``token_classification``, ``question_answering``, ``embedding`` and
ViT's ``image_classification``.
A model config names its head (``head="sequence_classification"``) and gives the head's options under
``options["head"]`` (``num_labels``, ``id2label``, ``problem_type``, ``pooling`` ...), validated like every block
option. The model supplies the shape (``HEAD_SUPPLIED``).

Task heads take ``(hidden (B, L, d_model), mask (B, L) bool or None)`` and compute their loss with ``loss`` as
``transformers`` does for the same problem type (MSE, cross entropy or BCE with logits; -100 ignored; QA the mean
of the start and end cross entropies with out-of-range positions ignored).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .registry import build, get, register

#: keys of a head that the model supplies (its width, vocabulary, norm factory, bias and hidden dropout).
HEAD_SUPPLIED = ("d_model", "vocab_size", "make_norm", "bias", "dropout")
#: heads that predict tokens (their logits cover the vocabulary); every other head is a task head.
LM_HEADS = ("lm", "mlm")
POOLINGS = ("cls", "mean", "max", "last", "mean_sqrt_len")
#: poolings of the image classifier: the class token, or the mean of the patch tokens.
IMAGE_POOLINGS = ("cls", "mean")
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
#: the layers between the pooled state and the classifier, as each family has them.
PRE_CLASSIFIERS = ("none", "bert", "roberta", "distilbert", "modernbert")
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": nn.functional.gelu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "silu": nn.functional.silu,
    "tanh": torch.tanh,
}


def pool(x: Tensor, mask: Tensor | None, pooling: str) -> Tensor:
    """One vector per sequence from hidden states, as sentence-transformers' ``Pooling`` computes it.

    ``cls``: the first real token; ``last``: the rightmost real token (left or right padding); ``mean`` / ``max`` /
    ``mean_sqrt_len``: over the real tokens (the sum divided by the square root of their count for the last).

    Shapes: ``x (B, L, D)``, ``mask (B, L)`` bool (True = real token) or None -> ``(B, D)``.

    Raises:
        ValueError: an unknown pooling.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {list(POOLINGS)}")
    if pooling == "cls":
        if mask is None:
            return x[:, 0]
        first = mask.int().argmax(-1)  # the first real token  # (B,)
        return x[torch.arange(x.shape[0], device=x.device), first]
    if pooling == "last":
        if mask is None:
            return x[:, -1]
        index = torch.arange(x.shape[1], device=x.device)
        last = (index * mask.long()).argmax(-1)  # the rightmost real token  # (B,)
        return x[torch.arange(x.shape[0], device=x.device), last]
    if pooling == "max":
        if mask is None:
            return x.max(dim=1).values
        return x.masked_fill(~mask[..., None], torch.finfo(x.dtype).min).max(dim=1).values
    weights = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if mask is None else mask.to(x.dtype)
    total = (x * weights[..., None]).sum(dim=1)  # (B, D)
    count = weights.sum(dim=1, keepdim=True).clamp(min=1e-9)  # (B, 1)
    return total / (count if pooling == "mean" else count.sqrt())


@register("head", "lm")
class LMHead(nn.Linear):
    """A projection of each position to the vocabulary (GPT-2's ``lm_head``; tied to the embedding by the model).

    Args:
        d_model: the width of the hidden states.
        vocab_size: the number of tokens.

    Shapes: ``(..., d_model)`` -> ``(..., vocab_size)``.
    """

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__(d_model, vocab_size, bias=False)


@register("head", "mlm")
class MLMHead(nn.Module):
    """BERT's prediction head: ``dense → GELU → norm``, then a decoder to the vocabulary (+ bias).

    ``bias`` is the dense layer's (ModernBERT has none); the decoder always has a bias.

    Shapes: ``(..., d_model)`` -> ``(..., vocab_size)``.
    """

    def __init__(self, d_model: int, vocab_size: int, make_norm: Callable[[], nn.Module], bias: bool = True) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model, bias=bias)
        self.norm = make_norm()
        self.decoder = nn.Linear(d_model, vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.norm(nn.functional.gelu(self.dense(x))))


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
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


class ClassifierHead(nn.Module):
    """The layers the families put between hidden states and their labels (shared by the classification heads).

    ``pre_classifier``: ``none``; ``bert`` (dense + tanh: BERT's pooler); ``roberta`` (dropout, dense + tanh:
    RoBERTa's head); ``distilbert`` (dense + ReLU); ``modernbert`` (dense + ``activation`` + norm). Then dropout
    (``classifier_dropout``, default the model's hidden dropout) and the classifier to ``n_out`` outputs.
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
        """``(..., d_model)`` -> ``(..., n_out)``."""
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
        """The problem type ``transformers`` would pick for these labels."""
        if self.problem_type is not None:
            return self.problem_type
        if self.num_labels == 1:
            return "regression"
        if labels.dtype in (torch.long, torch.int):
            return "single_label_classification"
        return "multi_label_classification"

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """MSE, cross entropy (-100 ignored) or BCE with logits, by problem type.

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
            labels: ``(B, 2)`` integer ``(start, end)`` token positions.

        Raises:
            ValueError: labels that are not an integer ``(B, 2)`` tensor.
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


@register("head", "image_classification")
class ImageClassificationHead(nn.Linear):
    """ViT's classifier (``ViTForImageClassification``): a linear layer on the pooled image tokens, the class
    token (``pooling="cls"``) or the mean of the patch tokens (``"mean"``, the class token left out).

    ``forward`` is the linear layer on pooled states (``pool`` pools); the loss is the cross entropy of single-label
    classes with -100 ignored.

    Shapes: ``pool``: ``(B, 1 + N, d_model)`` -> ``(B, d_model)``; ``forward``: ``(B, d_model)`` -> ``(B, num_labels)``.
    """

    def __init__(self, d_model: int, bias: bool = True, *, num_labels: int = 2, pooling: str = "cls") -> None:
        check_labels_map(num_labels, None, None)
        check_choice("pooling", pooling, IMAGE_POOLINGS)
        super().__init__(d_model, num_labels, bias=bias)
        self.num_labels, self.pooling = num_labels, pooling

    def pool(self, x: Tensor) -> Tensor:
        return x[:, 0] if self.pooling == "cls" else x[:, 1:].mean(dim=1)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Mean cross entropy over the images not labelled -100 (0, with zero gradient, when all are)."""
        total = nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
        return total / (labels != -100).sum().clamp(min=1)


@register("head", "embedding")
class EmbeddingHead(nn.Module):
    """A sentence embedding: the pooled hidden states, optionally L2-normalised (no parameters).

    ``max_seq_length`` (tokens kept by ``embed``; default the model's ``max_len``), ``prompts`` (name -> text
    prepended by ``embed(prompt=name)``) and ``default_prompt_name`` are what a sentence-transformers folder stores
    beside its pooling; they travel with the config.

    Shapes: ``(B, L, d_model)``, mask ``(B, L)`` -> ``(B, d_model)``.
    """

    def __init__(
        self, pooling: str = "mean", normalize: bool = False, max_seq_length: int | None = None,
        prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
    ) -> None:
        super().__init__()
        check_choice("pooling", pooling, POOLINGS)
        if max_seq_length is not None and max_seq_length < 1:
            raise ValueError(f"max_seq_length must be None or a positive integer, got {max_seq_length!r}")
        if prompts is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
            raise ValueError(f"prompts must map names to prompt texts, got {prompts!r}")
        if default_prompt_name is not None and default_prompt_name not in (prompts or {}):
            raise ValueError(
                f"default_prompt_name {default_prompt_name!r} is not one of the prompts {list(prompts or {})}"
            )
        self.pooling, self.normalize = pooling, normalize

    def forward(self, x: Tensor, mask: Tensor | None, normalize: bool | None = None) -> Tensor:
        pooled = pool(x, mask, self.pooling)
        if self.normalize if normalize is None else normalize:
            pooled = nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled


def check_tensor(labels: Any, name: str) -> None:
    if not isinstance(labels, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(labels).__name__}")


def check_shape(labels: Tensor, shapes: list[tuple[int, ...]], what: str) -> None:
    """Raise ``ValueError`` unless ``labels`` has one of ``shapes``."""
    if tuple(labels.shape) not in [tuple(s) for s in shapes]:
        raise ValueError(f"{what} labels must have shape {' or '.join(map(str, shapes))}, got {tuple(labels.shape)}")


def check_class_ids(labels: Tensor, num_labels: int) -> None:
    """Raise ``ValueError`` unless every label is -100 or a class id in ``[0, num_labels)``."""
    if torch.compiler.is_compiling() or not labels.numel():
        return
    outside = (labels != -100) & ((labels < 0) | (labels >= num_labels))
    if bool(outside.any()):
        raise ValueError(f"labels contain {int(labels[outside][0])}, outside [0, num_labels={num_labels}) and not -100")


def build_head(name: str, options: Mapping[str, Any], **supplied: Any) -> nn.Module:
    """Build the registered head ``name`` with its ``options`` and the keys of ``supplied`` its signature takes.

    Raises:
        ValueError: an unknown head, or options it does not accept.
    """
    params = inspect.signature(get("head", name)).parameters
    return build("head", name, **{k: v for k, v in supplied.items() if k in params}, **dict(options))


def check_head_options(name: str, options: Mapping[str, Any], allowed: tuple[str, ...], owner: str) -> dict[str, Any]:
    """Validate a config's head and its options (the head is built once on the meta device); return the options
    with ``id2label`` keyed by strings and ``label2id`` valued by ints, as ``config.json`` stores them.

    Raises:
        ValueError: a head ``owner`` cannot use (the usable ones are listed), or an invalid option value.
    """
    if name not in allowed:
        raise ValueError(f"head {name!r} does not fit a {owner}; expected one of {list(allowed)}")
    options = copy.deepcopy(dict(options))
    if isinstance(options.get("id2label"), Mapping):
        options["id2label"] = {str(k): v for k, v in options["id2label"].items()}
    if isinstance(options.get("label2id"), Mapping):
        label2id = options["label2id"]
        if any(isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).isdigit() for v in label2id.values()):
            raise ValueError(f"label2id must map labels to integer ids, got {dict(label2id)}")
        options["label2id"] = {k: int(v) for k, v in label2id.items()}
    with torch.device("meta"):
        build_head(name, options, d_model=1, vocab_size=1, make_norm=nn.Identity, bias=True, dropout=0.0)
    return options
