"""Preference tuning: DPO (Rafailov et al. 2023, the sigmoid loss) and SimPO (Meng et al. 2024, reference-free) as
Trainer losses over ``{"prompt", "chosen", "rejected"}`` pairs.

``PreferenceCollator`` tokenizes a pair as TRL's ``DPOTrainer`` does — prompt, prompt + chosen, prompt + rejected
(an EOS appended to plain-text completions, the chat template rendering conversational ones), the completion
starting where the prompt's ids and the pair's ids part — and stacks the chosen rows over the rejected rows with a
``completion_mask``. ``PreferenceLoss`` scores each row by the log-probability of its completion tokens (summed
for DPO, averaged for SimPO) and returns the *sum* of per-pair losses with ``count`` = the number of pairs, so the
Trainer's step is the mean over the step's pairs whatever the accumulation or the number of processes.

DPO's reference is the model with its adapters switched off when it trains LoRA adapters (no second copy), and
otherwise a frozen copy of the model as it was when the loss was built — sharded like the trained model at the first
batch when that model is sharded (FSDP2, tensor parallelism: ``training.preference_sharding``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocks.adapters import ADAPTED_LAYERS
from tokenization import Tokenizer
from tokenization.chat_spans import common_prefix_length

from .collators import pad_rows
from .distributed import unwrap_model
from .preference_sharding import shard_reference_like

METHODS = ("dpo", "simpo")


class PreferenceCollator:
    """Preference pairs -> ``input_ids``, ``attention_mask``, ``completion_mask`` ``(2B, L)``: the B chosen rows,
    then the B rejected rows, right-padded.

    Args:
        tokenizer: the model's tokenizer (with a chat template for conversational pairs).
        max_length: cut longer rows, keeping their start (TRL's ``keep_start``).

    Raises:
        ValueError: a tokenizer without a pad id, or a bad ``max_length``.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_length: int | None = None) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; preference batches are padded")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 2):
            raise ValueError(f"max_length must be an integer >= 2 or None, got {max_length!r}")
        self.tokenizer, self.max_length = tokenizer, max_length

    def tokenize(self, pair: Mapping[str, Any]) -> dict[str, list[int]]:
        """One pair as ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (TRL's split).

        Args:
            pair: ``{"prompt", "chosen", "rejected"}``, all strings or all lists of messages.

        Returns:
            The prompt's ids and each completion's own ids (after the part they share with the prompt).

        Raises:
            ValueError: a pair without the three fields, or a completion with no token of its own.
        """
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in pair]
        if missing:
            raise ValueError(f"a preference pair needs 'prompt', 'chosen' and 'rejected'; missing {missing}")
        tok = self.tokenizer
        if isinstance(pair["prompt"], str):
            eos = tok.special_tokens.get("eos") or ""
            bos = [tok.bos_token_id] if tok.bos_token_id is not None else []

            def encode(text: str) -> list[int]:
                return bos + tok.encode(text, add_special_tokens=False)

            prompt = encode(pair["prompt"])
            full = {k: encode(pair["prompt"] + (v if v.endswith(eos) else v + eos))
                    for k, v in ((k, pair[k]) for k in ("chosen", "rejected"))}
        else:
            prompt = tok.apply_chat_template(pair["prompt"], add_generation_prompt=True)
            full = {k: tok.apply_chat_template(list(pair["prompt"]) + list(pair[k])) for k in ("chosen", "rejected")}
        cut = min(common_prefix_length(prompt, ids) for ids in full.values())
        out = {"prompt_ids": prompt[:cut], **{f"{k}_ids": ids[cut:] for k, ids in full.items()}}
        if not out["chosen_ids"] or not out["rejected_ids"]:
            raise ValueError(f"a completion has no token of its own after the prompt {pair['prompt']!r:.60}")
        return out

    def __call__(self, pairs: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        """Batch ``pairs`` (raw pairs, or already split as ``tokenize`` returns).

        Returns:
            ``input_ids`` ``(2B, L)`` long, ``attention_mask`` and ``completion_mask`` ``(2B, L)`` bool.

        Raises:
            ValueError: an empty batch, or as ``tokenize``.
        """
        if not pairs:
            raise ValueError("cannot collate an empty batch")
        split = [p if "prompt_ids" in p else self.tokenize(p) for p in pairs]
        rows, masks = [], []
        for kind in ("chosen_ids", "rejected_ids"):
            for p in split:
                rows.append((list(p["prompt_ids"]) + list(p[kind]))[: self.max_length])
                masks.append(([0] * len(p["prompt_ids"]) + [1] * len(p[kind]))[: self.max_length])
        input_ids, attention_mask = pad_rows(rows, self.tokenizer.pad_token_id)  # type: ignore[arg-type]
        completion_mask, _ = pad_rows(masks, 0)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask.bool()}


def sequence_logps(model: nn.Module, batch: Mapping[str, Tensor], *, average: bool = False) -> Tensor:
    """The log-probability of each row's completion: the sum (or mean) over its completion tokens of
    ``log p(token | everything before it)``.

    Args:
        model: the language model to score with.
        batch: ``input_ids``, ``attention_mask`` and ``completion_mask`` (True at completion tokens).
        average: take the mean over the completion tokens instead of the sum (SimPO).

    Returns:
        One float32 log-probability per row.

    Shapes:
        ``batch["input_ids"]``, ``attention_mask``, ``completion_mask`` ``(N, L)`` -> ``(N,)``.
    """
    logits = model(batch["input_ids"], batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    mask = batch["completion_mask"][:, 1:].to(logits.dtype)
    token_logps = torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)  # (N, L - 1)
    total = (token_logps * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if average else total


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` without its adapters inside the block (the base model); nothing else changes.

    Args:
        model: the model (possibly wrapped for distributed training) whose adapter layers are switched off.

    Yields:
        Nothing: the body of the ``with`` block runs the base model; the active adapters are restored after it.

    Raises:
        ValueError: an adapter merged into the weights (the base weights are not there to run).
    """
    layers = [m for m in unwrap_model(model).modules() if isinstance(m, ADAPTED_LAYERS)]
    if any(layer.merged is not None for layer in layers):
        raise ValueError("an adapter is merged into the weights; unmerge it to run the base model as the reference")
    active = [layer.active for layer in layers]
    try:
        for layer in layers:
            layer.active = None
        yield
    finally:
        for layer, name in zip(layers, active, strict=True):
            layer.active = name


class PreferenceLoss:
    """The Trainer's loss for preference pairs (batches from ``PreferenceCollator``).

    - ``dpo``: ``-log σ(β [(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))])``, log-probabilities summed
      over the completion; rewards ``β (log π − log π_ref)``.
    - ``simpo``: ``-log σ(β (mean log π(y_w) − mean log π(y_l)) − γ)``, log-probabilities averaged over the
      completion, no reference; rewards ``β · mean log π``.

    ``label_smoothing`` ε mixes in the flipped pair: ``(1 − ε) ℓ(Δ) + ε ℓ(−Δ)`` (conservative DPO).

    Args:
        model: the model being trained (for DPO: the reference is built from it now, see the module docstring).
        method: ``"dpo"`` or ``"simpo"``.
        beta: β.
        gamma: SimPO's target margin γ (TRL's ``simpo_gamma``).
        label_smoothing: ε in [0, 0.5).
        reference: for DPO, the reference model to use instead (moved to the batches' device, never sharded).

    Raises:
        ValueError: an unknown method or a bad β, γ or ε.
    """

    def __init__(self, model: nn.Module, method: str = "dpo", *, beta: float = 0.1, gamma: float = 0.5,
                 label_smoothing: float = 0.0, reference: nn.Module | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown preference method {method!r}; expected one of {list(METHODS)}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
            raise ValueError(f"beta must be a positive number, got {beta!r}")
        if not isinstance(gamma, (int, float)) or isinstance(gamma, bool):
            raise ValueError(f"gamma must be a number, got {gamma!r}")
        if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
        self.method, self.beta, self.gamma, self.label_smoothing = method, float(beta), float(gamma), label_smoothing
        self.reference: nn.Module | None = None
        self.uses_adapters = False
        #: Whether the reference is a copy made here, sharded like the trained model at the first batch.
        self.owns_reference = False
        #: Whether that copy was sharded (the trained model was).
        self.reference_sharded = False
        self._reference_ready = False
        if method == "dpo":
            inner = unwrap_model(model)
            self.uses_adapters = reference is None and getattr(inner, "active_adapter", None) is not None
            if reference is not None:
                self.reference = reference
            elif not self.uses_adapters:
                self.reference = copy.deepcopy(inner).eval().requires_grad_(False)
                self.owns_reference = True
        #: The last batch's ``{"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        #: "logps/chosen", "logps/rejected"}`` (means over its pairs).
        self.metrics: dict[str, float] = {}

    def count(self, batch: Mapping[str, Tensor]) -> int:
        """The number of pairs in ``batch``.

        Args:
            batch: a batch from ``PreferenceCollator`` (chosen rows over rejected rows).

        Returns:
            Half its number of rows.

        Shapes: ``batch["input_ids"]``, ``attention_mask``, ``completion_mask`` ``(2B, L)````.
        """
        return int(batch["input_ids"].shape[0]) // 2

    def reference_logps(self, model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
        """``(2B,)`` the reference's completion log-probabilities (DPO), without gradient.

        Args:
            model: the model being trained (its adapters are switched off when the reference is the base model).
            batch: a batch from ``PreferenceCollator``.

        Returns:
            The summed completion log-probability of each row under the reference.

        Shapes: ``batch["input_ids"]``, ``attention_mask``, ``completion_mask`` ``(2B, L)```` -> ``(2B,)``.
        """
        with torch.no_grad():
            if self.uses_adapters:
                with adapters_disabled(model):
                    return sequence_logps(model, batch)
            assert self.reference is not None
            device = batch["input_ids"].device
            if next(self.reference.parameters()).device != device:
                self.reference.to(device)
            if not self._reference_ready:  # the trained model is sharded by now (the Trainer did it)
                self.reference_sharded = self.owns_reference and shard_reference_like(self.reference, model)
                self._reference_ready = True
            logps = sequence_logps(self.reference, batch)
            reshard = getattr(self.reference, "reshard", None) if self.reference_sharded else None
            if reshard is not None:  # FSDP2: its root keeps the gathered weights after a pass, awaiting a backward
                reshard()
            return logps

    def pair_losses(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Per-pair losses and rewards (the batch's mean rewards and log-probabilities go to ``metrics``).

        Args:
            model: the model being trained.
            batch: a batch from ``PreferenceCollator``.

        Returns:
            ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``; the losses carry the gradient.

        Shapes: ``batch["input_ids"]``, ``attention_mask``, ``completion_mask`` ``(2B, L)```` -> each ``(B,)``.
        """
        logps = sequence_logps(model, batch, average=self.method == "simpo")
        chosen, rejected = logps.chunk(2)
        if self.method == "dpo":
            ref_chosen, ref_rejected = self.reference_logps(model, batch).chunk(2)
            chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
            margin = self.beta * (chosen_ratio - rejected_ratio)
            rewards = (self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach())
        else:
            margin = self.beta * (chosen - rejected) - self.gamma
            rewards = (self.beta * chosen.detach(), self.beta * rejected.detach())
        eps = self.label_smoothing
        losses = -F.logsigmoid(margin) * (1 - eps) - F.logsigmoid(-margin) * eps
        self.metrics = {
            "rewards/chosen": rewards[0].mean().item(), "rewards/rejected": rewards[1].mean().item(),
            "rewards/margins": (rewards[0] - rewards[1]).mean().item(),
            "rewards/accuracies": (rewards[0] > rewards[1]).float().mean().item(),
            "logps/chosen": chosen.detach().mean().item(), "logps/rejected": rejected.detach().mean().item(),
        }
        return losses, rewards[0], rewards[1]

    def __call__(self, model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
        """The summed loss of the batch's pairs (a scalar with gradient)."""
        return self.pair_losses(model, batch)[0].sum()

