"""Losses: label-smoothed cross-entropy (§5.4 of *Attention Is All You Need*, ε_ls = 0.1), the token-level
loss objects the Trainer uses to weight every target token equally across micro-batches and processes, and
``TaskLoss`` for models with a task head (the head's loss by problem type).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from models import DecoderLM, EncoderLM
from models.tasks import TASK_HEADS

from .distributed import unwrap_model

IGNORE_INDEX = -100
_REDUCTIONS = ("mean", "sum", "none")


def label_smoothed_cross_entropy(
    logits: Tensor,
    target: Tensor,
    epsilon: float = 0.1,
    *,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    exclude_from_smoothing: int | None = None,
) -> Tensor:
    """Cross-entropy against ``(1 - ε) · one_hot(target) + ε · uniform``.

    With ``exclude_from_smoothing=None`` this equals
    ``torch.nn.functional.cross_entropy(logits, target, label_smoothing=ε, ignore_index=..., reduction=...)``;
    with a class id (usually the padding id) the uniform share skips that class, as the annotated
    transformer does, so the model is never taught to put mass on padding. Positions whose target is
    ``ignore_index`` contribute nothing; a batch with no target gives 0 (not NaN) for "mean".

    Args:
        logits: ``(..., C)`` unnormalised scores.
        target: ``(...)`` class ids, or ``ignore_index``.
        epsilon: the smoothing ε in [0, 1).
        ignore_index: the target value to skip.
        reduction: "mean" (over non-ignored targets), "sum" or "none" (per position, 0 where ignored).
        exclude_from_smoothing: a class that gets no smoothing mass.

    Returns:
        A scalar, or ``target``'s shape for "none".

    Raises:
        ValueError: shape mismatch, ε outside [0, 1), an unknown reduction, or targets outside [0, C).

    Shapes: ``logits (..., C)``, ``target (...)``.
    """
    if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits (..., C) {tuple(logits.shape)} and target {tuple(target.shape)} do not match")
    n_classes = logits.shape[-1]
    keep = target != ignore_index
    if keep.any():
        lo, hi = int(target[keep].min()), int(target[keep].max())
        if lo < 0 or hi >= n_classes:
            raise ValueError(f"target ids must be in [0, {n_classes}) or {ignore_index}, got {lo if lo < 0 else hi}")
    if exclude_from_smoothing is not None and not 0 <= exclude_from_smoothing < n_classes:
        raise ValueError(f"exclude_from_smoothing must be a class id in [0, {n_classes}), got {exclude_from_smoothing}")

    log_probs = torch.log_softmax(logits.float(), dim=-1)
    safe_target = target.masked_fill(~keep, 0)
    nll = -log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    if exclude_from_smoothing is None:
        smooth = -log_probs.mean(dim=-1)
    else:
        others = torch.ones(n_classes, dtype=torch.bool, device=logits.device)
        others[exclude_from_smoothing] = False
        smooth = -log_probs[..., others].mean(dim=-1)
    loss = ((1.0 - epsilon) * nll + epsilon * smooth) * keep
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / keep.sum().clamp(min=1)


class LabelSmoothedCrossEntropy(nn.Module):
    """Module form of ``label_smoothed_cross_entropy`` (same arguments).

    Args:
        epsilon: the smoothing mass ε_ls (the paper: 0.1).
        ignore_index: targets with this value are left out.
        reduction: ``"mean"`` (over the targets kept), ``"sum"`` or ``"none"``.
        exclude_from_smoothing: a class that gets no smoothing mass (e.g. the padding id).

    Raises:
        ValueError: a bad ``epsilon`` or ``reduction`` (checked when built, not at the first batch).

    Shapes: logits ``(N, C)``, target ``(N,)`` -> a scalar, or ``(N,)`` with ``reduction="none"``.
    """

    def __init__(self, epsilon: float = 0.1, *, ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                 exclude_from_smoothing: int | None = None) -> None:
        super().__init__()
        label_smoothed_cross_entropy(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), epsilon,
                                     reduction=reduction)  # validate now, not at the first batch
        self.epsilon, self.ignore_index = epsilon, ignore_index
        self.reduction, self.exclude_from_smoothing = reduction, exclude_from_smoothing

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return label_smoothed_cross_entropy(
            logits, target, self.epsilon, ignore_index=self.ignore_index, reduction=self.reduction,
            exclude_from_smoothing=self.exclude_from_smoothing,
        )


class TokenLoss:
    """The Trainer's loss: the *sum* of per-token losses of one batch, and how many tokens it covers.

    Summing and counting (rather than averaging per batch) lets the Trainer divide by the token count of
    the whole optimizer step — across accumulated micro-batches and processes — so every target token
    weighs the same and a multi-process step equals a single-process one.

    Args:
        shift: predict ``labels[:, t + 1]`` from position ``t`` (causal LMs; the others align labels).
        label_smoothing: ε of ``label_smoothed_cross_entropy``.
        exclude_from_smoothing: a class that gets no smoothing mass (e.g. the padding id).
        label_key: the batch entry that holds the labels; every other entry goes to the model.

    Raises:
        ValueError: ``label_smoothing`` outside [0, 1).
    """

    def __init__(self, *, shift: bool = False, label_smoothing: float = 0.0,
                 exclude_from_smoothing: int | None = None, label_key: str = "labels") -> None:
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        self.shift, self.label_smoothing = shift, label_smoothing
        self.exclude_from_smoothing, self.label_key = exclude_from_smoothing, label_key

    def _labels(self, batch: Mapping[str, Any]) -> Tensor:
        if self.label_key not in batch:
            raise ValueError(f"batch has no {self.label_key!r} entry (keys: {sorted(batch)})")
        labels = batch[self.label_key]
        if self.shift:
            # Shift the labels rather than slicing the logits, which would copy the largest tensor.
            labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
        return labels

    def count(self, batch: Mapping[str, Any]) -> int:
        """Number of target tokens in ``batch`` (labels that are not -100).

        Args:
            batch: a collated batch holding ``label_key``.

        Returns:
            The count (after the shift, for causal LMs).
        """
        return int((self._labels(batch) != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> Tensor:
        """Summed loss of ``model`` on ``batch`` (a scalar with gradient)."""
        labels = self._labels(batch)
        out = model(**{k: v for k, v in batch.items() if k != self.label_key})
        loss = label_smoothed_cross_entropy(
            out.logits, labels, self.label_smoothing, reduction="sum",
            exclude_from_smoothing=self.exclude_from_smoothing,
        )
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            # A mixture-of-experts router loss is a mean over the batch: weighted by its target tokens, it stays a
            # token-weighted mean once the Trainer divides the step's sum by the step's token count.
            loss = loss + aux * int((labels != IGNORE_INDEX).sum())
        return loss


class MaskedTokenLoss(TokenLoss):
    """``TokenLoss`` for models that can run their output head on labelled positions only
    (``EncoderLM(..., labels=..., masked_only=True)`` returns ``(N, vocab_size)`` logits for the N labelled
    positions): in MLM training that skips ~85% of the vocabulary projection.

    Args:
        label_smoothing: ε of ``label_smoothed_cross_entropy``.
        exclude_from_smoothing: a class that gets no smoothing mass.
        label_key: the batch entry that holds the labels.
    """

    def __init__(self, *, label_smoothing: float = 0.0, exclude_from_smoothing: int | None = None,
                 label_key: str = "labels") -> None:
        super().__init__(shift=False, label_smoothing=label_smoothing,
                         exclude_from_smoothing=exclude_from_smoothing, label_key=label_key)

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> Tensor:
        labels = self._labels(batch)
        inputs = {k: v for k, v in batch.items() if k != self.label_key}
        logits = model(**inputs, labels=labels, masked_only=True).logits  # (N, vocab_size)
        return label_smoothed_cross_entropy(
            logits, labels[labels != IGNORE_INDEX], self.label_smoothing, reduction="sum",
            exclude_from_smoothing=self.exclude_from_smoothing,
        )


class TaskLoss:
    """The Trainer's loss for a model with a task head: the head's own loss, chosen by problem type as
    ``transformers`` chooses it (MSE for regression, cross entropy for single-label classes, BCE with logits for
    multi-label targets; token classification ignores -100; QA is the mean of the start and end cross entropies).

    ``count`` is what the loss averages over, so that the Trainer's step (the summed losses divided by the step's
    count) is that mean across micro-batches and processes: the labelled examples or tokens for integer class
    labels (-100 not counted), the rows for float targets (regression, multi-label) and for QA positions.

    Args:
        head: the model's task head (``config.head``), one of ``models.tasks.TASK_HEADS`` but ``embedding``.
        label_key: the batch entry that holds the labels; every other entry goes to the model.

    Raises:
        ValueError: a head without a loss.
    """

    def __init__(self, head: str, *, label_key: str = "labels") -> None:
        heads = [h for h in TASK_HEADS if h != "embedding"]
        if head not in heads:
            raise ValueError(f"TaskLoss needs a task head with a loss, one of {heads}; got {head!r}")
        self.head, self.label_key = head, label_key

    def _labels(self, batch: Mapping[str, Any]) -> Tensor:
        if self.label_key not in batch:
            raise ValueError(f"batch has no {self.label_key!r} entry (keys: {sorted(batch)})")
        return batch[self.label_key]

    def count(self, batch: Mapping[str, Any]) -> int:
        """The number of labelled units in ``batch`` (see the class docstring).

        Args:
            batch: a collated batch holding the labels.

        Returns:
            Examples (QA, regression) or labelled tokens and examples (the others, -100 left out).
        """
        labels = self._labels(batch)
        if self.head == "question_answering" or labels.dtype.is_floating_point:
            return int(labels.shape[0])
        return int((labels != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> Tensor:
        """The head's mean loss on ``batch`` times ``count(batch)`` (a scalar with gradient)."""
        labels = self._labels(batch)
        out = model(**{k: v for k, v in batch.items() if k != self.label_key}, labels=labels)
        n = self.count(batch)
        if n == 0:  # every label ignored: no loss, and no NaN from an empty mean
            return out.logits.sum() * 0.0
        return out.loss * n


def default_loss(model: nn.Module) -> TokenLoss | TaskLoss:
    """The Trainer's default loss for ``model``: the head's loss for a task head (``TaskLoss``), else plain
    token cross-entropy, shifted for ``DecoderLM`` (its labels are the inputs themselves), on the labelled
    positions only for ``EncoderLM``, aligned for everything else.

    Args:
        model: a zoo model, possibly inside a DDP wrapper.

    Returns:
        ``TaskLoss(head)`` for a model whose ``config.head`` is a task head of ``models.tasks.TASK_HEADS``,
        ``MaskedTokenLoss()`` for an ``EncoderLM``, else ``TokenLoss(shift=<is a DecoderLM>)``.

    Raises:
        ValueError: the ``embedding`` head, which has no loss (pass a ``loss_fn``).
    """
    inner = unwrap_model(model)
    head = getattr(getattr(inner, "config", None), "head", None)
    if head == "embedding":
        raise ValueError("the 'embedding' head has no loss of its own; pass the Trainer a loss_fn")
    if head in TASK_HEADS:
        return TaskLoss(head)
    if isinstance(inner, EncoderLM):
        return MaskedTokenLoss()
    return TokenLoss(shift=isinstance(inner, DecoderLM))
