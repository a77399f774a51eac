"""Choosing the next token from logits: repetition penalty, temperature, top-k, nucleus (top-p), greedy or sampled.

The processors run in the order ``transformers`` uses (repetition penalty, temperature, top-k, top-p), so
settings carry over between the two libraries. Every function works on a whole batch at once.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from torch import Tensor


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, §4.1): logits of tokens already in the sequence are
    divided by ``penalty`` when positive and multiplied by it when negative, so ``penalty > 1`` always
    makes a repeat less likely.

    Args:
        logits: next-token logits.
        seen: bool, True where the token already occurs in the row.
        penalty: the factor (> 0; 1 changes nothing).

    Returns:
        The penalised logits (a new tensor).

    Shapes: logits ``(B, V)``, seen ``(B, V)`` -> ``(B, V)``.
    """
    # An extreme penalty (1e300 is a valid one) in float32 is inf or 0: clamped to the dtype's range, so that a zero
    # logit stays 0 (not 0 · inf = NaN) and a finite logit stays finite (a seen token is pushed to the dtype's
    # extreme, never past it); logits already infinite stay as they are.
    info = torch.finfo(logits.dtype)
    penalty = min(max(float(penalty), info.tiny), info.max)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(info.min, info.max)
    return torch.where(seen & torch.isfinite(logits), penalised, logits)


def apply_presence_frequency_penalty(logits: Tensor, counts: Tensor, presence: float, frequency: float) -> Tensor:
    """OpenAI's presence and frequency penalties: ``logit[j] - count[j] · frequency - (count[j] > 0) · presence``,
    where ``count[j]`` is how many times the row has generated token ``j`` so far.

    Args:
        logits: next-token logits.
        counts: how many times each row has generated each token.
        presence: the presence penalty, subtracted once from every token generated at least once.
        frequency: the frequency penalty, subtracted once per time a token was generated.

    Returns:
        The penalised logits (a new tensor).

    Shapes: logits ``(B, V)``, counts ``(B, V)`` integer -> ``(B, V)``.
    """
    return logits - counts.to(logits.dtype) * frequency - (counts > 0).to(logits.dtype) * presence


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row and set the rest to ``-inf`` (Fan et al. 2018).

    Tokens tied with the k-th largest logit are kept too. ``k >= V`` keeps everything.

    Args:
        logits: next-token logits.
        k: how many of the largest logits to keep per row.

    Returns:
        The filtered logits (``logits`` itself when ``k >= V``).

    Shapes: ``(B, V)`` -> ``(B, V)``.
    """
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p_filter(logits: Tensor, p: float) -> Tensor:
    """Min-p filtering (Nguyen et al. 2024; llama.cpp, vLLM): drop the tokens whose probability is below ``p``
    times the most likely token's, i.e. whose logit is below the maximum + ``log p``. The most likely token is
    always kept.

    Args:
        logits: next-token logits.
        p: the fraction of the best token's probability a token needs (0: keep all).

    Returns:
        The logits with the dropped tokens at ``-inf`` (a new tensor, or ``logits`` itself for ``p <= 0``).

    Shapes: ``(B, V)`` -> ``(B, V)``.
    """
    if p <= 0.0:
        return logits
    floor = logits.amax(dim=-1, keepdim=True) + math.log(p)  # (B, 1)
    return logits.masked_fill(logits < floor, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering (Holtzman et al. 2020): keep the smallest set of most likely tokens whose total
    probability reaches ``p`` and set the rest to ``-inf``. The most likely token is always kept.

    Args:
        logits: next-token logits.
        p: the probability mass to keep (``p >= 1`` keeps everything).

    Returns:
        The filtered logits (``logits`` itself when ``p >= 1``).

    Shapes: ``(B, V)`` -> ``(B, V)``.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already hold at least p of the mass.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    # The first token has no mass before it, but a p that underflows to 0 in float32 (1e-300) would drop it too:
    # it is kept explicitly (a row with nothing left to sample from cannot exist).
    drop_sorted[..., 0] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def infinite_logits_share(logits: Tensor) -> Tensor:
    """Rows holding a ``+inf`` logit as the limit of a finite row: the tokens at ``+inf`` share the whole mass (their
    logits become 0, every other one ``-inf``). Without this, the softmax of such a row is NaN (inf - inf), and so is
    the shift that a temperature applies. Other rows are returned unchanged.

    Args:
        logits: scores over the vocabulary in the last dimension.

    Returns:
        The logits with each row holding ``+inf`` turned into 0 at its infinite tokens and ``-inf`` elsewhere.

    Shapes: ``(..., V)`` -> ``(..., V)``.
    """
    infinite = logits.amax(dim=-1, keepdim=True) == float("inf")
    return torch.where(infinite, torch.where(logits == float("inf"), 0.0, float("-inf")), logits)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits; validated on construction.

    Args:
        do_sample: draw from the (processed) distribution; False picks the arg-max (greedy).
        temperature: divides the logits before sampling (> 0; used only when sampling).
        top_k: keep only the k most likely tokens when sampling (>= 1, or None for all).
        top_p: nucleus mass in (0, 1] kept when sampling (None or 1 for all).
        repetition_penalty: CTRL's penalty (> 0) on tokens already in the sequence, applied in greedy
            decoding as well; None or 1 disables it.
        presence_penalty: OpenAI's presence penalty in [-2, 2]: subtracted once from the logit of every token
            the request has already generated (the prompt does not count, as in the OpenAI API and vLLM).
        frequency_penalty: OpenAI's frequency penalty in [-2, 2]: subtracted from a token's logit once per time
            the request has generated it.
        min_p: when sampling, drop tokens less likely than ``min_p`` times the most likely one in the tempered
            distribution (as vLLM does); a number in [0, 1], None or 0 for all.

    Raises:
        ValueError: ``temperature <= 0`` with sampling, ``top_k < 1``, ``top_p`` outside (0, 1],
            ``repetition_penalty <= 0``, a presence or frequency penalty outside [-2, 2], ``min_p`` outside
            [0, 1], or values of the wrong type.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 when sampling, got {self.temperature!r}; "
                "use do_sample=False for greedy decoding"
            )
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and (not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {self.top_p!r}")
        if self.repetition_penalty is not None and (
            not _is_real(self.repetition_penalty)
            or not math.isfinite(self.repetition_penalty)
            or self.repetition_penalty <= 0
        ):
            raise ValueError(f"repetition_penalty must be None or a number > 0, got {self.repetition_penalty!r}")
        if self.min_p is not None and (not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be None or a number in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")

    @property
    def uses_history(self) -> bool:
        """Whether choosing a token needs to know which tokens the row already holds."""
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    @property
    def uses_counts(self) -> bool:
        """Whether choosing a token needs how often the row has generated each token (presence and frequency
        penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def next_tokens(
        self,
        logits: Tensor,
        seen: Tensor | None = None,
        generator: torch.Generator | None = None,
        counts: Tensor | None = None,
    ) -> Tensor:
        """Choose one token per row.

        Args:
            logits: next-token logits.
            seen: bool, True where a token already occurs in the row (needed if ``uses_history``).
            generator: the random generator for sampling (default: torch's global one).
            counts: how many times the row has generated each token (needed if ``uses_counts``).

        Returns:
            Token ids, long.

        Shapes: logits ``(B, V)``, seen ``(B, V)``, counts ``(B, V)`` -> ``(B,)``.
        """
        if not self.do_sample:
            return self._penalised(logits, seen, counts).argmax(dim=-1)
        probs = self.probabilities(logits, seen, counts)
        # torch.multinomial raises on a row with no valid distribution (only a row of NaN or of -inf logits gives
        # one): such a row takes greedy's choice, so that one row can never fail a step that holds others.
        valid = probs.sum(dim=-1, keepdim=True) > 0  # False for a NaN sum
        if not bool(valid.all()):
            greedy = self._penalised(logits, seen, counts).argmax(dim=-1)
            probs = torch.where(valid, probs, torch.nn.functional.one_hot(greedy, probs.shape[-1]).to(probs.dtype))
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def probabilities(self, logits: Tensor, seen: Tensor | None = None, counts: Tensor | None = None) -> Tensor:
        """The distribution sampling draws from: repetition penalty, presence and frequency penalties,
        temperature, top-k, top-p, then softmax (vLLM's order).

        Speculative decoding needs these probabilities themselves (for the rejection rule), not only a draw.

        Args:
            logits: next-token logits, any leading shape.
            seen: bool, True where a token already occurs in the row (needed if ``uses_history``).
            counts: how many times the row has generated each token (needed if ``uses_counts``).

        Returns:
            float32 probabilities summing to 1 over the last dimension.

        Shapes: logits ``(..., V)`` -> ``(..., V)``.
        """
        scores = infinite_logits_share(self._penalised(logits, seen, counts))
        if self.temperature != 1.0:
            # Shift each row's maximum to 0 before dividing: raw logits over a tiny temperature overflow to inf
            # and the softmax to NaN, while shifted ones go to -inf except the maximum (sampling tends to greedy
            # decoding, as it should). The maximum stays exactly 0 even when the temperature underflows to 0 in
            # float32 (0 / 0 would be NaN).
            # A temperature beyond float32's range (1e300) would be inf, and a shift that overflowed to -inf over inf
            # is NaN: it is clamped to the largest finite float32 (the limit is the same: a flat distribution).
            shifted = scores - scores.amax(dim=-1, keepdim=True)
            temperature = min(self.temperature, torch.finfo(scores.dtype).max)
            scores = torch.where(shifted == 0, 0.0, shifted / temperature)
        if self.min_p is not None:
            scores = min_p_filter(scores, self.min_p)
        if self.top_k is not None:
            scores = top_k_filter(scores, self.top_k)
        if self.top_p is not None:
            scores = top_p_filter(scores, self.top_p)
        return scores.softmax(dim=-1)

    def _penalised(self, logits: Tensor, seen: Tensor | None, counts: Tensor | None) -> Tensor:
        scores = logits.float()
        if self.uses_history:
            if seen is None:
                raise ValueError("repetition_penalty needs the tokens already seen (seen=None given)")
            scores = apply_repetition_penalty(scores, seen, self.repetition_penalty)
        if self.uses_counts:
            if counts is None:
                raise ValueError("presence_penalty and frequency_penalty need the generated tokens' counts "
                                 "(counts=None given)")
            scores = apply_presence_frequency_penalty(scores, counts, self.presence_penalty,
                                                      self.frequency_penalty)
        return scores


def seen_tokens(ids: Tensor, mask: Tensor | None, vocab_size: int) -> Tensor:
    """Which vocabulary entries occur among the real tokens of each row.

    Args:
        ids: token ids.
        mask: True at real tokens, or None when nothing is padded.
        vocab_size: the size of the vocabulary V.

    Returns:
        True where the token occurs in the row.

    Shapes: ids ``(B, L)``, mask ``(B, L)`` bool (True = real token) -> ``(B, V)`` bool.
    """
    counts = torch.zeros(ids.shape[0], vocab_size, dtype=torch.long, device=ids.device)
    weights = torch.ones_like(ids) if mask is None else mask.long()
    # scatter_add, not scatter: a padded position may share its id with a real token of the same row.
    return counts.scatter_add_(1, ids, weights) > 0


def nan_rows(logits: Tensor, live: Tensor | None = None) -> Tensor:
    """Which rows (of those still choosing, ``live``) hold a NaN among their logits: a token chosen from them
    would mean nothing (``argmax`` of NaN logits picks a NaN's index; sampling fails inside ``torch.multinomial``).

    Args:
        logits: next-token logits.
        live: True at the rows still choosing, or None for all rows.

    Returns:
        True at the live rows holding a NaN.

    Shapes: logits ``(B, V)``, live ``(B,)`` bool -> ``(B,)`` bool.
    """
    bad = torch.isnan(logits.amax(dim=-1))  # a max reduction propagates NaN: one pass, no (B, V) mask
    return bad if live is None else bad & live


def has_nan(logits: Tensor) -> bool:
    """Whether any of ``logits`` is NaN: one max reduction and one host read (about a tenth of the time of
    ``isnan(...).any()`` on a CPU, for a vocabulary of 8k-50k), the per-step check of a CPU decoding loop.

    Args:
        logits: the logits to check.

    Returns:
        True when some element is NaN (False for an empty tensor).

    Shapes: logits any shape.
    """
    return math.isnan(logits.amax().item()) if logits.numel() else False


def raise_nan_logits(bad: Tensor, step: int) -> None:
    """Raise the ``ValueError`` of NaN logits at decoding ``step`` (0: the prompt's), naming the rows ``bad``.

    Args:
        bad: True at the rows whose logits hold a NaN.
        step: the decoding step, for the message.

    Raises:
        ValueError: always, naming the step and the rows.

    Shapes: bad ``(B,)`` bool.
    """
    rows = bad.nonzero().flatten().tolist()
    raise ValueError(
        f"the next-token logits of step {step} are NaN in row(s) {rows}; expected finite logits to choose tokens "
        "from (the model's weights or inputs hold NaN or inf values)"
    )


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
