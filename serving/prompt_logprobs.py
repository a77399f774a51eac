"""The log-probabilities of a prompt's own tokens: what the completions API returns for ``echo=true`` with
``logprobs``, and what lm-evaluation-harness's ``local-completions`` backend scores answers with.

One forward pass per batch of prompts (longest first, right-padded: padding after a prompt is invisible to a
causal model at the prompt's positions), the log-softmax over the vocabulary at every position but the last.
Token ``i``'s entry is its log-probability given tokens ``< i`` and the ``top`` most likely tokens there; the first
token has nothing before it and gets None, as OpenAI answers. ``score_prompts`` runs it on an engine's model
between two of its steps (``AsyncEngine.call`` / ``ProcessEngine.call``), with the LoRA slots routing no token.
"""

from __future__ import annotations

from typing import Any

import torch

from .requests import TokenLogprob

#: Padded tokens per forward pass at most (a batch holds at least one prompt).
MAX_BATCH_TOKENS = 4096
#: Log-probabilities (positions x vocabulary) held per forward pass at most, beyond one prompt's.
MAX_BATCH_LOGPROBS = 2**26


def prompt_logprobs(model: Any, prompts: list[list[int]], top: int = 0, *, max_batch_tokens: int = MAX_BATCH_TOKENS,
                    before_forward: Any = None) -> list[list[TokenLogprob | None]]:
    """Score every token of every prompt under ``model``.

    Args:
        model: a causal LM (``DecoderLM``) whose output has ``logits``.
        prompts: token ids, one list per prompt.
        top: how many most likely tokens to report per position (0: none).
        max_batch_tokens: padded tokens per forward pass at most.
        before_forward: called with no arguments before each forward pass (None: nothing).

    Returns:
        Per prompt, one entry per token: None for the first, then ``TokenLogprob(token, logprob, top)``.

    Raises:
        ValueError: ``top`` outside 0..vocabulary size, or a token id outside the vocabulary.

    Shapes: each forward takes ``(b, L)`` ids and reads ``(b, L - 1, V)`` log-probabilities.
    """
    vocab = int(model.config.vocab_size)
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab:
        raise ValueError(f"logprobs={top!r}: expected an integer from 0 to the vocabulary size {vocab}")
    for i, ids in enumerate(prompts):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt[{i}] holds token ids outside the vocabulary of {vocab}: {bad[:5]}")
    out: list[list[TokenLogprob | None]] = [[None] if ids else [] for ids in prompts]
    order = sorted((i for i, ids in enumerate(prompts) if len(ids) > 1), key=lambda i: -len(prompts[i]))
    device = next(iter(model.parameters())).device
    start = 0
    with torch.inference_mode():
        while start < len(order):
            width = len(prompts[order[start]])
            tokens_per_batch = min(max_batch_tokens, MAX_BATCH_LOGPROBS // vocab)
            chunk = order[start:start + max(1, tokens_per_batch // width)]
            start += len(chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
            if before_forward is not None:
                before_forward()
            logp = model(ids.to(device)).logits[:, :-1].float().log_softmax(-1).cpu()  # (b, width - 1, V)
            chosen = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (b, width - 1)
            best = logp.topk(top, dim=-1) if top else None
            for r, i in enumerate(chunk):
                n = len(prompts[i]) - 1
                values, tokens = chosen[r, :n].tolist(), prompts[i][1:]
                tops = [{}] * n if best is None else [
                    dict(zip(ix, vs, strict=True)) for ix, vs in zip(best.indices[r, :n].tolist(),
                                                                       best.values[r, :n].tolist(), strict=True)]
                out[i] += [TokenLogprob(t, v, tp) for t, v, tp in zip(tokens, values, tops, strict=True)]
    return out


def score_prompts(engine: Any, prompts: list[list[int]], top: int = 0) -> list[list[TokenLogprob | None]]:
    """``prompt_logprobs`` on an engine's model, called between two of its steps (``AsyncEngine.call``,
    ``ProcessEngine.call``): the base model, its LoRA slots (if any) routing no token.

    Args:
        engine: the ``serving.Engine``.
        prompts: token ids, one list per prompt.
        top: how many most likely tokens to report per position.

    Returns:
        As ``prompt_logprobs``.

    Raises:
        ValueError: a prompt longer than the engine's context, or as ``prompt_logprobs``.
    """
    for i, ids in enumerate(prompts):
        if len(ids) > engine.context:
            raise ValueError(f"prompt: prompt[{i}] has {len(ids)} tokens; the model's context is {engine.context}")
    loras = getattr(engine, "loras", None)
    return prompt_logprobs(engine.model, prompts, top,
                           before_forward=None if loras is None else lambda: loras.routing.route([]))
