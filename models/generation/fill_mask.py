"""``EncoderLM.fill_mask`` / ``fill_mask_text``: the most likely tokens at ``[MASK]`` positions."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch
from torch import Tensor

from .requests import check_token_head, resolve_token
from .steps import eval_mode


@dataclasses.dataclass
class FillMaskOutput:
    """The most likely tokens at each masked position.

    Attributes:
        positions: ``(N, 2)`` long, ``(row, index)`` of each masked position in row-major order.
        token_ids: ``(N, top_k)`` long, most likely first.
        probs: ``(N, top_k)`` float, their probabilities (descending; a row sums to at most 1).
    """

    positions: Tensor
    token_ids: Tensor
    probs: Tensor


class EncoderLMFillMaskMixin:
    """``fill_mask`` for ``EncoderLM``."""

    def fill_mask(
        self,
        input_ids: Tensor,
        mask_token_id: int | None = None,
        top_k: int = 5,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> FillMaskOutput:
        """The ``top_k`` most likely tokens, with probabilities, at every mask token of the batch.

        The prediction head runs on the masked positions only.

        Args:
            input_ids: ``(B, L)`` ids containing at least one ``mask_token_id`` at a real position.
            mask_token_id: the mask id (default ``config.mask_token_id``).
            top_k: candidates per position, in ``[1, vocab_size]``.
            attention_mask: ``(B, L)`` bool, True = real token; masks at padded positions are ignored.
            token_type_ids: ``(B, L)`` segment ids.

        Returns:
            ``FillMaskOutput`` (positions, token ids, probabilities).

        Raises:
            ValueError: bad ids or masks, no mask id configured, no mask token in ``input_ids``, or ``top_k``
                outside ``[1, vocab_size]``.

        Shapes: ``input_ids (B, L)`` -> ``positions (N, 2)``, ``token_ids (N, top_k)``, ``probs (N, top_k)``.
        """
        config = self.config
        check_token_head(self, "fill_mask")
        self.check_ids(input_ids, "input_ids")
        mask = self.check_mask(attention_mask, tuple(input_ids.shape), "attention_mask")
        if mask_token_id is None:
            mask_token_id = config.mask_token_id
        mask_id = resolve_token(mask_token_id, None, "mask_token_id", config.vocab_size)
        if mask_id is None:
            raise ValueError("mask_token_id is None (and so is config.mask_token_id); give the [MASK] id")
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= config.vocab_size:
            raise ValueError(f"top_k must be an integer in [1, vocab_size={config.vocab_size}], got {top_k!r}")
        is_mask = input_ids == mask_id
        if mask is not None:
            is_mask &= mask
        positions = is_mask.nonzero()  # (N, 2)
        if positions.shape[0] == 0:
            raise ValueError(f"input_ids contain no mask token (id {mask_id}) at a real position")
        with torch.inference_mode(), eval_mode(self):
            hidden = self.encode(input_ids, mask, token_type_ids)[0]  # (B, L, d_model)
            logits = self.mlm_head(hidden[positions[:, 0], positions[:, 1]])  # (N, V)
            best = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
        return FillMaskOutput(positions.clone(), best.indices.clone(), best.values.clone())

    def fill_mask_text(self, text: str, top_k: int = 5) -> list[list[dict[str, Any]]]:
        """``fill_mask`` on a text, through the tokenizer attached as ``model.tokenizer``.

        The tokenizer needs ``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``mask_token_id`` (None
        falls back to ``config.mask_token_id``), as ``tokenization.Tokenizer`` has.

        Args:
            text: a text holding the tokenizer's mask token (e.g. ``"[MASK]"``) at least once.
            top_k: candidates per mask.

        Returns:
            One list per mask token, in text order, of ``top_k`` dicts, most likely first: ``token_id``,
            ``token`` (its decoded text), ``score`` (probability) and ``sequence`` (the text decoded with this
            mask filled in).

        Raises:
            ValueError: no tokenizer attached, ``text`` not a string, no mask token in the text, or as
                ``fill_mask``.
        """
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("fill_mask_text needs a tokenizer: attach one with model.tokenizer = Tokenizer(...)")
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            mask_id = self.config.mask_token_id
        ids = list(tokenizer.encode(text))
        if mask_id is None or mask_id not in ids:
            raise ValueError(f"text contains no mask token (id {mask_id}): {text!r}")
        device = next(self.parameters()).device
        found = self.fill_mask(torch.tensor([ids], dtype=torch.long, device=device), mask_id, top_k)
        results = []
        for (_, position), token_ids, probs in zip(
            found.positions.tolist(), found.token_ids.tolist(), found.probs.tolist(), strict=True
        ):
            candidates = []
            for token_id, prob in zip(token_ids, probs, strict=True):
                filled = list(ids)
                filled[position] = token_id
                candidates.append({
                    "token_id": token_id,
                    "token": tokenizer.decode([token_id]),
                    "score": prob,
                    "sequence": tokenizer.decode(filled),
                })
            results.append(candidates)
        return results

