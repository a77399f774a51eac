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

The classification heads live in ``blocks.classification_heads``, pooling in ``blocks.pooling`` and the label
checks in ``blocks.label_checks``; this module re-exports them, so ``from blocks.heads import ...`` reaches every
head.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .classification_heads import (
    ACTIVATIONS,
    PRE_CLASSIFIERS,
    PROBLEM_TYPES,
    ClassifierHead,
    QuestionAnsweringHead,
    SequenceClassificationHead,
    TokenClassificationHead,
)
from .label_checks import check_choice, check_class_ids, check_labels_map, check_shape, check_tensor
from .pooling import POOLINGS, pool
from .registry import build, get, register

__all__ = [
    "ACTIVATIONS", "HEAD_SUPPLIED", "IMAGE_POOLINGS", "LM_HEADS", "POOLINGS", "PRE_CLASSIFIERS", "PROBLEM_TYPES",
    "ClassifierHead", "EmbeddingHead", "ImageClassificationHead", "LMHead", "MLMHead", "QuestionAnsweringHead",
    "SequenceClassificationHead", "TokenClassificationHead", "build_head", "check_choice", "check_class_ids",
    "check_head_options", "check_labels_map", "check_shape", "check_tensor", "pool",
]

#: keys of a head that the model supplies (its width, vocabulary, norm factory, bias and hidden dropout).
HEAD_SUPPLIED = ("d_model", "vocab_size", "make_norm", "bias", "dropout")
#: heads that predict tokens (their logits cover the vocabulary); every other head is a task head.
LM_HEADS = ("lm", "mlm")
#: poolings of the image classifier: the class token, or the mean of the patch tokens.
IMAGE_POOLINGS = ("cls", "mean")


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

    Args:
        d_model: the width of the hidden states (and of the dense layer).
        vocab_size: the number of tokens the decoder scores.
        make_norm: builds the norm after the activation (the model's norm factory: LayerNorm for BERT).
        bias: whether the dense layer has a bias.

    Shapes: ``(..., d_model)`` -> ``(..., vocab_size)``.
    """

    def __init__(self, d_model: int, vocab_size: int, make_norm: Callable[[], nn.Module], bias: bool = True) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model, bias=bias)
        self.norm = make_norm()
        self.decoder = nn.Linear(d_model, vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.norm(nn.functional.gelu(self.dense(x))))


@register("head", "image_classification")
class ImageClassificationHead(nn.Linear):
    """ViT's classifier (``ViTForImageClassification``): a linear layer on the pooled image tokens, the class
    token (``pooling="cls"``) or the mean of the patch tokens (``"mean"``, the class token left out).

    ``forward`` is the linear layer on pooled states (``pool`` pools); the loss is the cross entropy of single-label
    classes with -100 ignored.

    Args:
        d_model: the width of the image tokens.
        bias: whether the classifier has a bias.
        num_labels: the number of classes (>= 1).
        pooling: ``"cls"`` or ``"mean"`` (``IMAGE_POOLINGS``).

    Raises:
        ValueError: ``num_labels`` is not a positive integer, or an unknown ``pooling``.

    Shapes: ``pool``: ``(B, 1 + N, d_model)`` -> ``(B, d_model)``; ``forward``: ``(B, d_model)`` -> ``(B, num_labels)``.
    """

    def __init__(self, d_model: int, bias: bool = True, *, num_labels: int = 2, pooling: str = "cls") -> None:
        check_labels_map(num_labels, None, None)
        check_choice("pooling", pooling, IMAGE_POOLINGS)
        super().__init__(d_model, num_labels, bias=bias)
        self.num_labels, self.pooling = num_labels, pooling

    def pool(self, x: Tensor) -> Tensor:
        """The vector the classifier reads for each image: its class token, or the mean of its patch tokens.

        Args:
            x: the encoder's output, the class token first.

        Returns:
            One vector per image.

        Shapes: x ``(B, 1 + N, d_model)`` -> ``(B, d_model)``.
        """
        return x[:, 0] if self.pooling == "cls" else x[:, 1:].mean(dim=1)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Mean cross entropy over the images not labelled -100 (0, with zero gradient, when all are).

        Args:
            logits: the classifier's output.
            labels: a class id per image in ``[0, num_labels)``, or -100 to leave the image out.

        Returns:
            The scalar loss, in float32.

        Shapes: logits ``(B, num_labels)``, labels ``(B,)`` long -> ``()``.
        """
        total = nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
        return total / (labels != -100).sum().clamp(min=1)


@register("head", "embedding")
class EmbeddingHead(nn.Module):
    """A sentence embedding: the pooled hidden states, optionally L2-normalised (no parameters).

    ``max_seq_length`` (tokens kept by ``embed``; default the model's ``max_len``), ``prompts`` (name -> text
    prepended by ``embed(prompt=name)``) and ``default_prompt_name`` are what a sentence-transformers folder stores
    beside its pooling; they travel with the config.

    Args:
        pooling: how the token states become one vector (one of ``POOLINGS``).
        normalize: L2-normalise the pooled vector (a ``forward`` call may override it).
        max_seq_length: the tokens ``embed`` keeps per text (None: the model's ``max_len``).
        prompts: prompt name -> the text ``embed(prompt=name)`` prepends.
        default_prompt_name: the prompt ``embed`` uses when none is named (one of ``prompts``).

    Raises:
        ValueError: an unknown pooling, a ``max_seq_length`` below 1, prompts that are not strings, or a
            ``default_prompt_name`` that names no prompt.

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


def build_head(name: str, options: Mapping[str, Any], **supplied: Any) -> nn.Module:
    """Build the registered head ``name`` with its ``options`` and the keys of ``supplied`` its signature takes.

    Args:
        name: the registered ``head`` name (``"sequence_classification"``).
        options: the head's options from the config (``num_labels``, ``pooling`` ...).
        **supplied: what the model supplies (``HEAD_SUPPLIED``: ``d_model``, ``vocab_size``, ``make_norm``,
            ``bias``, ``dropout``); the keys the head's constructor does not take are left out.

    Returns:
        The head module.

    Raises:
        ValueError: an unknown head, or options it does not accept.
    """
    params = inspect.signature(get("head", name)).parameters
    return build("head", name, **{k: v for k, v in supplied.items() if k in params}, **dict(options))


def check_head_options(name: str, options: Mapping[str, Any], allowed: tuple[str, ...], owner: str) -> dict[str, Any]:
    """Validate a config's head and its options (the head is built once on the meta device); return the options
    with ``id2label`` keyed by strings and ``label2id`` valued by ints, as ``config.json`` stores them.

    Args:
        name: the head the config names.
        options: its options.
        allowed: the heads the model class can carry.
        owner: the model class's name (for the message).

    Returns:
        A deep copy of ``options``, label maps normalised.

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
