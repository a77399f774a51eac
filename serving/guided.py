"""The engine's guided decoding: a request's constraint (``models.generation.constraints``) and OpenAI's
``logit_bias`` checked into its ``RequestSpec``, and applied to the logits of every row that chooses a token in a
step — the bitmasks of all constrained rows filled together (llguidance's thread pool), one masked copy of the
logits.

Each sample holds its own ``ConstraintState`` (``Sequence.guide``): it is advanced with every token the sample
chooses and never touched by preemption (a preempted sample recomputes the keys and values of tokens it chose
already, and chooses nothing until they are cached) or by prefix caching (shared blocks hold keys and values, not
grammar state); a forked sample (``n > 1``) starts from a copy of its parent's state.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import torch
from torch import Tensor

from models.generation.constraints import Constraint, apply_bitmask, compile_constraint, fill_bitmasks, new_bitmask

from .requests import RequestSpec, Sequence


def check_logit_bias(logit_bias: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (``{token id: bias}``, ids as ints or strings as JSON sends them; None) as sorted pairs.

    Args:
        logit_bias: the request's ``logit_bias``, or None.
        vocab_size: the number of token ids.

    Returns:
        ``(token id, bias)`` pairs sorted by id (empty for None).

    Raises:
        ValueError: not a mapping, a key that is not a token id in ``[0, vocab_size)`` or a bias outside
            [-100, 100].
    """
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {type(logit_bias).__name__}")
    pairs = {}
    for key, bias in logit_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if isinstance(key, bool) or str(token) != str(key).strip() or not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not -100 <= bias <= 100 \
                or not math.isfinite(bias):
            raise ValueError(f"logit_bias[{key!r}]={bias!r}: expected a number in [-100, 100]")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def guided_spec(spec: RequestSpec, constraint: Any, logit_bias: Any, tokenizer: Any, vocab_size: int,
                eos: int | None) -> RequestSpec:
    """``spec`` with its constraint compiled (cached per distinct constraint) and its logit bias checked.

    Args:
        spec: the checked request.
        constraint: a ``Constraint`` (or an already compiled one), or None.
        logit_bias: the request's ``logit_bias``, or None.
        tokenizer: the engine's tokenizer (needed by a ``Constraint``).
        vocab_size: the number of token ids.
        eos: the EOS token id, allowed where the constraint may end.

    Returns:
        ``spec`` itself when it has neither, else a copy holding them.

    Raises:
        ValueError: an invalid constraint or logit bias, or a constraint without a tokenizer.
    """
    bias = check_logit_bias(logit_bias, vocab_size)
    compiled = None
    if constraint is not None:
        if tokenizer is None and isinstance(constraint, Constraint):
            raise ValueError("constraint needs a tokenizer; the engine has none")
        compiled = compile_constraint(constraint, tokenizer, vocab_size, eos)
    if compiled is None and not bias:
        return spec
    return dataclasses.replace(spec, constraint=compiled, logit_bias=bias)


def guided_logits(logits: Tensor, scheduled: list[tuple[Sequence, int]]) -> Tensor:
    """The logits rows choose from: each row's logit bias added and its constraint's disallowed tokens at
    ``-inf``; ``logits`` itself when no row has either.

    Rows that are a prefill chunk (choosing nothing) are left as they are.

    Args:
        logits: the step's logits.
        scheduled: the step's ``(sequence, n_tokens)`` pairs, one per row.

    Returns:
        The logits to choose from (float32 when any row was changed).

    Shapes: logits ``(B, V)``, one row per scheduled sequence -> ``(B, V)``.
    """
    choosing = [(row, seq) for row, (seq, n) in enumerate(scheduled)
                if seq.num_computed + n >= len(seq.tokens) and (seq.guide is not None or seq.spec.logit_bias)]
    if not choosing:
        return logits
    out = logits.float().clone()
    for row, seq in choosing:
        if seq.spec.logit_bias:
            ids, biases = zip(*seq.spec.logit_bias, strict=True)
            out[row, list(ids)] += torch.tensor(biases, device=out.device)
    states: list[Any] = [None] * len(scheduled)
    for row, seq in choosing:
        states[row] = seq.guide
    if any(state is not None for state in states):
        # One bitmask for the whole batch (free rows stay all-allowed) and one masked_fill: few kernels per step.
        bitmask = new_bitmask(len(states), logits.shape[-1])
        fill_bitmasks(states, bitmask)
        out = apply_bitmask(out, bitmask)
    return out
