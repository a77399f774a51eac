"""Beam search with the GNMT length penalty, as the Transformer paper decodes (Vaswani et al. 2017, §6.1).

The search is batched over sources and beams and talks to the model through one ``step`` function, so it
knows nothing about caches: ``step`` reorders whatever state it keeps by the ``parents`` it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from .sampling import nan_rows, raise_nan_logits

#: ``step(tokens (N, 1), parents (N,) | None, sources_changed) -> logits (N, V)``: row ``i`` of this step
#: continues row ``parents[i]`` of the previous one (None: the same rows as before). ``sources_changed`` says
#: the rows no longer map to the sources as before (beams were expanded or finished sources dropped), so
#: per-source state (encoder memory, cross-attention keys/values) must be reindexed too; otherwise it is
#: identical for every beam of a source and may be left alone.
StepFn = Callable[[Tensor, "Tensor | None", bool], Tensor]


def gnmt_length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """``lp(Y) = ((5 + |Y|) / 6) ** alpha`` (Wu et al. 2016, eq. 14); a hypothesis scores ``log P(Y|X) / lp(Y)``.

    ``alpha = 0`` ranks by raw log-probability; larger values favour longer outputs.

    Args:
        length: the hypothesis length ``|Y|`` (a number, or a tensor of lengths).
        alpha: the length-penalty exponent.

    Returns:
        The penalty ``lp(Y)``, of ``length``'s kind.

    Shapes: length any shape -> same shape.
    """
    return ((5 + length) / 6) ** alpha


@dataclasses.dataclass
class BeamSearchOutput:
    """The best hypothesis of each source.

    Attributes:
        sequences: ``(B, T)`` generated ids (no start token), EOS included, ``pad_token_id`` after it.
        scores: ``(B,)`` length-normalised log-probabilities ``log P(Y|X) / lp(|Y|)``.
        lengths: ``(B,)`` number of generated tokens of each hypothesis (EOS included).
    """

    sequences: Tensor
    scores: Tensor
    lengths: Tensor


def beam_search(
    step: StepFn,
    *,
    batch_size: int,
    start_token_id: int,
    num_beams: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int,
    length_penalty: float = 0.6,
    early_stopping: bool = True,
    device: torch.device | str | None = None,
) -> BeamSearchOutput:
    """Keep the ``num_beams`` most probable prefixes of each source and return its best hypothesis.

    At every step each live beam is extended by every token. Of the ``2 · num_beams`` best extensions, those
    ending in EOS become finished hypotheses, scored ``log P(Y|X) / lp(|Y|)``, and the best ``num_beams``
    others stay alive (as in tensor2tensor, which the paper used). A beam's log-probability only falls as it
    grows, so its best possible final score is known; with ``early_stopping`` a source stops as soon as no
    live beam can still beat its best finished hypothesis: all its beams have ended or been ruled out, and
    the paper's "terminate early when possible" (§6.1) never changes the result. Sources that are done leave
    the batch. At ``max_new_tokens`` the live beams compete with the finished ones as they are.

    The greedy hypothesis always survives with ``num_beams=1`` (it is the live beam or among the finished
    ones), so one beam never scores below greedy decoding; with more beams that usually, but not provably,
    holds as well.

    Args:
        step: the model, see ``StepFn``; it is first called with ``batch_size`` rows of the start token.
        batch_size: number of sources B.
        start_token_id: the first decoder input.
        num_beams: beams per source (>= 1).
        max_new_tokens: the most tokens generated after the start token (>= 0).
        eos_token_id: the end-of-sequence id (None: hypotheses end only at ``max_new_tokens``).
        pad_token_id: written after EOS in ``sequences``.
        length_penalty: the GNMT ``alpha``.
        early_stopping: stop a source once its result is settled (False: decode every source to
            ``max_new_tokens``; same result, more work).
        device: where the search's own tensors live (the model's device).

    Returns:
        ``BeamSearchOutput`` with the best hypothesis of each source.

    Raises:
        ValueError: ``num_beams < 1``, ``batch_size < 1`` or ``max_new_tokens < 0``; NaN logits from ``step``
            (checked at the host sync each step makes anyway).

    Shapes: ``sequences (B, T)`` with ``T <= max_new_tokens``, ``scores (B,)``, ``lengths (B,)``.
    """
    for name, value, low in (("num_beams", num_beams, 1), ("batch_size", batch_size, 1),
                             ("max_new_tokens", max_new_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    k, b, t_max = num_beams, batch_size, max_new_tokens
    neg_inf = float("-inf")
    # Finished hypotheses of every source, best first (kept for all B; only the active rows are touched). They
    # are as wide as the longest one so far, not max_new_tokens: that may be huge while EOS comes early.
    fin_scores = torch.full((b, k), neg_inf, device=device)
    fin_seqs = torch.full((b, k, 0), pad_token_id, dtype=torch.long, device=device)
    fin_lens = torch.zeros((b, k), dtype=torch.long, device=device)
    if t_max == 0:
        return BeamSearchOutput(fin_seqs[:, 0], torch.zeros(b, device=device), fin_lens[:, 0])

    active = torch.arange(b, device=device)  # (A,) sources still searching
    alive_seqs = torch.empty((b, 1, 0), dtype=torch.long, device=device)  # (A, beams, t)
    alive_scores = torch.zeros((b, 1), device=device)  # (A, beams) log P of each prefix
    tokens = torch.full((b, 1), start_token_id, dtype=torch.long, device=device)
    parents: Tensor | None = None
    sources_changed = False

    for t in range(1, t_max + 1):
        logits = step(tokens, parents, sources_changed)  # (A * beams, V)
        n_src, n_beams = alive_scores.shape
        vocab = logits.shape[-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1).view(n_src, n_beams, vocab)
        candidates = (alive_scores[:, :, None] + log_probs).view(n_src, n_beams * vocab)
        top_scores, top_index = candidates.topk(min(2 * k, n_beams * vocab), dim=-1)  # (A, C), best first
        top_beam, top_token = top_index // vocab, top_index % vocab

        ends = torch.zeros_like(top_token, dtype=torch.bool)
        if eos_token_id is not None:
            ends = top_token == eos_token_id
            ended = ends & (top_scores > neg_inf)
            if bool(ended.any()):
                seqs = _extend(alive_seqs, top_beam, top_token)  # (A, C, t)
                new_scores = torch.where(ended, top_scores / gnmt_length_penalty(t, length_penalty), neg_inf)
                fin_scores, fin_seqs, fin_lens = _merge_finished(
                    fin_scores, fin_seqs, fin_lens, active, new_scores, seqs, t, pad_token_id
                )

        # The best k extensions that do not end stay alive.
        alive_scores, pick = top_scores.masked_fill(ends, neg_inf).topk(min(k, top_scores.shape[1]), dim=-1)
        beam, next_tokens = top_beam.gather(1, pick), top_token.gather(1, pick)  # (A, k)
        alive_seqs = torch.cat(
            [alive_seqs.gather(1, beam[:, :, None].expand(-1, -1, t - 1)), next_tokens[:, :, None]], dim=2
        )
        parents = (torch.arange(n_src, device=beam.device)[:, None] * n_beams + beam).view(-1)
        sources_changed = n_beams != beam.shape[1]

        done = _sources_done(fin_scores[active, 0], alive_scores[:, 0], t, t_max, length_penalty, early_stopping)
        # One host sync for both questions: NaN logits (nothing chosen from them may be returned), sources done.
        nan, any_done = torch.stack([torch.isnan(logits.amax()), done.any()]).tolist()  # amax propagates NaN
        if nan:
            raise_nan_logits(nan_rows(logits), t - 1)
        if any_done:
            keep = (~done).nonzero().squeeze(-1)
            if keep.numel() == 0:
                alive_seqs = alive_seqs[:0]
                break
            width = beam.shape[1]
            parents = parents.view(n_src, width)[keep].view(-1)
            active, alive_seqs, alive_scores = active[keep], alive_seqs[keep], alive_scores[keep]
            next_tokens = next_tokens[keep]
            sources_changed = True
        if t == t_max:
            break
        tokens = next_tokens.reshape(-1, 1)

    if alive_seqs.shape[0]:
        # Sources that reached max_new_tokens: their live beams compete as they are.
        length = alive_seqs.shape[2]
        scores = alive_scores / gnmt_length_penalty(length, length_penalty)
        fin_scores, fin_seqs, fin_lens = _merge_finished(
            fin_scores, fin_seqs, fin_lens, active, scores, alive_seqs, length, pad_token_id
        )

    lengths = fin_lens[:, 0]
    longest = int(lengths.max())
    return BeamSearchOutput(fin_seqs[:, 0, :longest], fin_scores[:, 0], lengths)


def _extend(alive_seqs: Tensor, beam: Tensor, token: Tensor) -> Tensor:
    """Candidate sequences: each candidate's parent prefix plus its token.

    Shapes: alive_seqs ``(A, beams, t-1)``, beam/token ``(A, C)`` -> ``(A, C, t)``.
    """
    prefix = alive_seqs.gather(1, beam[:, :, None].expand(-1, -1, alive_seqs.shape[2]))
    return torch.cat([prefix, token[:, :, None]], dim=2)


def _merge_finished(
    fin_scores: Tensor,
    fin_seqs: Tensor,
    fin_lens: Tensor,
    active: Tensor,
    scores: Tensor,
    seqs: Tensor,
    length: int,
    pad: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Add hypotheses ``(A, C)`` of ``length`` tokens to the finished sets of the ``active`` sources, keeping
    the best k of old and new; the finished sequences widen (with ``pad``) to the longest hypothesis.

    Shapes: fin_* ``(B, k[, W])``, scores ``(A, C)``, seqs ``(A, C, length)`` -> ``(B, k)``,
    ``(B, k, max(W, length))``, ``(B, k)``.
    """
    k, width = fin_scores.shape[1], max(fin_seqs.shape[2], seqs.shape[2])
    fin_seqs, seqs = (torch.nn.functional.pad(x, (0, width - x.shape[2]), value=pad) for x in (fin_seqs, seqs))
    merged_scores = torch.cat([fin_scores[active], scores], dim=1)  # (A, k + C)
    merged_seqs = torch.cat([fin_seqs[active], seqs], dim=1)
    merged_lens = torch.cat([fin_lens[active], torch.full_like(scores, length, dtype=torch.long)], dim=1)
    best, index = merged_scores.topk(k, dim=-1)
    fin_scores[active] = best
    fin_seqs[active] = merged_seqs.gather(1, index[:, :, None].expand(-1, -1, width))
    fin_lens[active] = merged_lens.gather(1, index)
    return fin_scores, fin_seqs, fin_lens


def _sources_done(
    best_finished: Tensor, best_alive: Tensor, t: int, t_max: int, alpha: float, early_stopping: bool
) -> Tensor:
    """Which active sources can stop after step ``t``: those without live beams, and with ``early_stopping``
    those whose best finished score no live beam can reach any more.

    Shapes: best_finished ``(A,)`` (normalised), best_alive ``(A,)`` (log-probability) -> ``(A,)`` bool.
    """
    no_beam_left = best_alive == float("-inf")
    if not early_stopping:
        return no_beam_left
    # Log-probabilities only fall, so a live beam ends at most at its current log-probability, under the
    # most favourable length penalty of the lengths it can still reach (lp is monotonic in the length).
    bound = torch.maximum(
        best_alive / gnmt_length_penalty(t + 1, alpha), best_alive / gnmt_length_penalty(t_max, alpha)
    )
    return (best_finished >= bound) | no_beam_left
