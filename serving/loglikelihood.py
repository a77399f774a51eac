"""Log-likelihoods of continuations given contexts, batched, each shared context run once: lm-eval's
``loglikelihood`` requests for the ``zoo`` backend (``serving.lm_eval_model``).

A multiple-choice question is one context with several answers. Requests are grouped by their context's tokens,
the groups taken longest context first, ``batch_size`` contexts at a time, under ``torch.inference_mode``:

1. the contexts, left-padded, in one forward pass into a KV cache; the last position's logits score each answer's
   first token;
2. their answers (all tokens but the last), sorted by length and right-padded, ``batch_size`` rows of their mean
   length per forward pass (fewer long ones, more short ones), each row reading its context's cached keys and
   values (the cache's rows selected per answer): position ``j`` scores answer token ``j + 1``.

Each token's log-probability is its logit minus the log-sum-exp over the vocabulary (no log-softmax is written). A
context and continuation longer than ``max_length + 1`` lose the context's start, as lm-eval's ``hf`` backend cuts
them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from blocks.kv_cache import reorder_caches
from models.core.stack import new_caches


def continuation_logprobs(model: Any, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, batch_size: int = 16,
                          max_length: int | None = None, pad_id: int = 0,
                          progress: Callable[[int], Any] | None = None) -> list[tuple[float, bool]]:
    """The log-probability of each continuation after its context, and whether greedy decoding would produce it.

    Args:
        model: a causal LM (``DecoderLM``) that takes ``attention_mask`` and a KV ``cache``.
        pairs: ``(context ids, continuation ids)`` per request; contexts non-empty.
        batch_size: contexts per forward pass, and continuations per forward pass after them (as many tokens as this
            many of their mean length).
        max_length: the model's window (None: ``model.config.max_len``): ``context + continuation[:-1]`` longer
            than it keeps the context's last tokens.
        pad_id: the id padding is written with (never attended to).
        progress: called with the number of requests done after each batch.

    Returns:
        ``(sum of the continuation's token log-probabilities, every token the argmax)`` per request, in order.

    Raises:
        ValueError: an empty context, or a continuation empty or longer than ``max_length``.

    Shapes: contexts ``(G, Lc)``, then continuations ``(R, Lk)`` after a cache of ``Lc`` positions.
    """
    window = int(max_length or model.config.max_len)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (context, continuation) in enumerate(pairs):
        if not continuation or len(continuation) > window:
            raise ValueError(f"request {i}: a continuation of {len(continuation)} tokens; expected 1 to "
                             f"max_length={window}")
        if not context:
            raise ValueError(f"request {i}: an empty context; lm-eval conditions on the prefix token (BOS)")
        keep = window + 1 - len(continuation)  # as (context + continuation)[-(window + 1):] cuts it
        groups.setdefault(tuple(context[-keep:]), []).append(i)
    order = sorted(groups, key=lambda c: -len(c))
    results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    device = next(iter(model.parameters())).device
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            contexts = order[start:start + batch_size]
            rows = [(g, i) for g, c in enumerate(contexts) for i in groups[c]]
            rows.sort(key=lambda row: -len(pairs[row[1]][1]))  # continuations of like lengths batched together
            for i, score in zip((i for _, i in rows), _score_contexts(
                    model, contexts, [pairs[i][1] for _, i in rows], [g for g, _ in rows], batch_size, pad_id, device),
                    strict=True):
                results[i] = score
            if progress is not None:
                progress(len(rows))
    return results


def _score_contexts(model: Any, contexts: list[tuple[int, ...]], continuations: list[Sequence[int]], owner: list[int],
                    batch_size: int, pad_id: int, device: torch.device) -> list[tuple[float, bool]]:
    """The contexts into a cache (left-padded, one forward), then their continuations ``batch_size`` rows at a time,
    each row after its context's cached keys and values."""
    width_c = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width_c), pad_id, dtype=torch.long)
    mask = torch.zeros(len(contexts), width_c, dtype=torch.bool)
    for g, context in enumerate(contexts):
        ids[g, width_c - len(context):] = torch.tensor(context)
        mask[g, width_c - len(context):] = True
    ids, mask = ids.to(device), mask.to(device)
    longest = max(len(k) for k in continuations) - 1  # a continuation's last token is scored, never fed
    cache = new_caches(model.layers, width_c + longest) if longest else None
    first = model(ids, attention_mask=mask, cache=cache, logits_to_keep=1).logits[:, -1]  # (G, V)
    scores = []
    # Tokens per forward pass: batch_size rows of the mean length, so long continuations go fewer to a pass (the
    # padding stays small) and short ones more.
    budget = batch_size * max(1.0, sum(len(k) - 1 for k in continuations) / len(continuations))
    start = 0
    while start < len(continuations):
        width = max(1, len(continuations[start]) - 1)  # sorted longest first: the pass's width
        rows = range(start, min(len(continuations), start + max(1, int(budget // width))))
        start = rows.stop
        index = torch.tensor([owner[r] for r in rows], device=device)
        last = rows.stop == len(continuations)
        scores += _score_rows(model, [continuations[r] for r in rows], first.index_select(0, index),
                              mask.index_select(0, index), cache if last or cache is None else copy.deepcopy(cache),
                              index, pad_id, device)
    return scores


def _score_rows(model: Any, continuations: list[Sequence[int]], first: torch.Tensor, mask: torch.Tensor,
                cache: Any, index: torch.Tensor, pad_id: int, device: torch.device) -> list[tuple[float, bool]]:
    """Continuations after their contexts: ``first`` ``(R, V)`` scores each one's first token; the rest are fed
    after the context cache's rows ``index`` (``mask``: those contexts' padding)."""
    target = torch.tensor([k[0] for k in continuations], device=device)
    total, greedy = _token_scores(first, target)  # (R,) each
    width_k = max(len(k) for k in continuations) - 1
    if width_k:
        reorder_caches(cache, index)  # each continuation row reads its context's keys and values
        feed = torch.full((len(continuations), width_k), pad_id, dtype=torch.long)
        target = torch.zeros(len(continuations), width_k, dtype=torch.long)
        real = torch.zeros(len(continuations), width_k, dtype=torch.bool)
        for r, k in enumerate(continuations):
            feed[r, :len(k) - 1] = torch.tensor(k[:-1])
            target[r, :len(k) - 1] = torch.tensor(k[1:])
            real[r, :len(k) - 1] = True
        # Right padding after a continuation is invisible to its real positions (causal); only the context's
        # left padding is masked.
        full_mask = torch.cat([mask, torch.ones(len(continuations), width_k, dtype=torch.bool, device=device)], 1)
        logits = model(feed.to(device), attention_mask=full_mask, cache=cache).logits  # (R, Lk, V)
        real = real.to(device)
        logp, hit = _token_scores(logits, target.to(device))  # (R, Lk) each
        total = total + torch.where(real, logp, 0.0).sum(1)
        greedy = greedy & (hit | ~real).all(1)
    return [(float(t), bool(g)) for t, g in zip(total.tolist(), greedy.tolist(), strict=True)]


def _token_scores(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's log-probability (its logit minus the log-sum-exp: no log-softmax over the vocabulary is
    written) and whether it is the argmax. Shapes: logits ``(..., V)``, target ``(...)``."""
    logits = logits.float()
    logp = logits.gather(-1, target[..., None]).squeeze(-1) - logits.logsumexp(-1)
    return logp.double(), logits.argmax(-1) == target
