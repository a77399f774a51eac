"""Constrained decoding: a JSON schema, a regular expression, a grammar or a choice among strings enforced while
decoding, as a token bitmask on the logits of every step (llguidance; why it and not xgrammar:
docs/structured-outputs.md).

- ``Constraint`` — what the output must match: ``Constraint.json_schema(schema)``, ``.json_object()``,
  ``.regex(pattern)``, ``.grammar(lark_or_gbnf)``, ``.choice([...])``. A small frozen, hashable, picklable value
  (it crosses the pipe to an engine process); ``check()`` validates it without a tokenizer.
- ``compile_constraint(constraint, tokenizer, vocab_size, eos)`` — the constraint bound to a vocabulary: compiled
  once per distinct (tokenizer, vocabulary, EOS, constraint) and cached; ``.start()`` gives a fresh
  ``ConstraintState`` (one per decoded row).
- ``ConstraintState`` — one row's position in the grammar: ``fill`` its bitmask, ``advance`` with the chosen token,
  ``rollback`` (speculative decoding), ``copy`` (``n > 1`` samples).
- ``fill_bitmasks`` fills the rows of a batch together (llguidance's thread pool); ``apply_bitmask`` sets the
  logits of disallowed tokens to ``-inf`` (allowed ones are untouched); ``RowConstraints`` is what a decoding loop
  holds for its batch.

A constrained row ends with the EOS token once its grammar is complete (the mask then allows only EOS, or EOS
among the tokens that continue a still-open grammar).

The constraint itself and its compilation (``Constraint``, ``compile_constraint``, ``ConstraintState``) are
``models.generation.grammar``, re-exported here; this module holds the batch side: bitmasks and the rows of a loop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .grammar import (
    CACHE_SIZE,
    JSON_OPTIONS,
    KINDS,
    CompiledConstraint,
    Constraint,
    ConstraintState,
    compile_constraint,
    library,
    vocabulary,
)

__all__ = [
    "CACHE_SIZE", "JSON_OPTIONS", "KINDS", "PARALLEL_CPUS", "PARALLEL_ROWS", "CompiledConstraint", "Constraint",
    "ConstraintState", "RowConstraints", "allowed_tokens", "apply_bitmask", "compile_constraint", "fill_bitmasks",
    "library", "new_bitmask", "row_constraints", "vocabulary",
]

#: A batch's masks are filled by llguidance's thread pool from this many constrained rows, on machines with at least
#: ``PARALLEL_CPUS`` cores; otherwise one after the other in this thread (each takes ~10-40 us for a 2k-49k
#: vocabulary). On 2 cores the pool's thread competes with torch's spinning OpenMP threads: 16 rows took 2.1 ms per
#: step in the pool against 0.2 ms in turn.
PARALLEL_ROWS = 8
PARALLEL_CPUS = 8


_EXECUTOR: list[Any] = []


def new_bitmask(rows: int, vocab_size: int) -> Tensor:
    """An all-allowed bitmask for ``rows`` rows.

    Args:
        rows: the number of rows.
        vocab_size: the number of tokens a row covers.

    Returns:
        A CPU int32 tensor with every bit set.

    Shapes: -> ``(rows, ceil(vocab_size / 32))`` int32.
    """
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_bitmasks(states: Sequence[ConstraintState | None], bitmask: Tensor) -> None:
    """Fill ``bitmask[i]`` for every row ``i`` whose state is not None (in llguidance's thread pool for a large batch
    on a machine with many cores, see ``PARALLEL_ROWS``); the other rows are left as they are.

    Args:
        states: one per row of ``bitmask``; None for a row without a constraint.
        bitmask: the batch's bitmask, filled in place.

    Raises:
        ValueError: ``bitmask`` is not a contiguous int32 CPU tensor (pool path; ``ConstraintState.fill`` checks the
            other).

    Shapes: bitmask ``(len(states), W)`` int32.
    """
    rows = [(s.matcher, i) for i, s in enumerate(states) if s is not None]
    if len(rows) < PARALLEL_ROWS or (os.cpu_count() or 1) < PARALLEL_CPUS:
        for _, i in rows:
            states[i].fill(bitmask, i)
    else:
        if not _EXECUTOR:
            _EXECUTOR.append(library().LLExecutor())
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError(f"bitmask must be a contiguous int32 CPU tensor, got {bitmask.dtype} on {bitmask.device}")
        _EXECUTOR[0].unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def allowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """The bitmask as bools: True where a token is allowed (bit ``j % 32`` of word ``j // 32``).

    Unpacked by numpy: torch's element-wise kernels would open an OpenMP parallel region per operation, each waiting
    for every thread (tens of milliseconds per step on a busy 2-core machine).

    Args:
        bitmask: the packed mask (any device; it is read on the CPU).
        vocab_size: the tokens to unpack (the padding bits of the last word are dropped).

    Returns:
        A CPU bool tensor.

    Shapes: ``(B, W)`` int32 -> ``(B, vocab_size)`` bool.
    """
    words = bitmask.cpu().numpy().astype("<i4", copy=False)  # little-endian words: byte b holds bits 8b..8b+7
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.astype(bool))


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """``logits`` with the tokens that ``bitmask`` disallows set to ``-inf`` (the allowed ones unchanged).

    Args:
        logits: one row of logits per row of the mask.
        bitmask: the packed mask (``fill_bitmasks``).

    Returns:
        A new tensor on ``logits``' device and dtype.

    Shapes: logits ``(B, V)``, bitmask ``(B, W)`` -> ``(B, V)``.
    """
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1]).to(logits.device), float("-inf"))


class RowConstraints:
    """The constraints of a decoding loop's batch: one state per row (None: that row is free).

    Args:
        states: one per row.
        vocab_size: the logits' width.
    """

    def __init__(self, states: Sequence[ConstraintState | None], vocab_size: int) -> None:
        self.states = list(states)
        self.bitmask = new_bitmask(len(self.states), vocab_size)

    def mask(self, logits: Tensor, live: Tensor | None = None) -> Tensor:
        """The logits with every constrained live row masked.

        Args:
            logits: the step's logits.
            live: False for rows that are finished (their states are not consulted), or None for all rows live.

        Returns:
            The masked logits (free rows unchanged).

        Shapes: logits ``(B, V)``, live ``(B,)`` bool -> ``(B, V)``.
        """
        alive = [True] * len(self.states) if live is None else live.tolist()
        states = [s if ok else None for s, ok in zip(self.states, alive, strict=True)]
        self.bitmask.fill_(-1)
        fill_bitmasks(states, self.bitmask)
        return apply_bitmask(logits, self.bitmask)

    def advance(self, tokens: Tensor, live: Tensor | None = None) -> None:
        """Every constrained live row takes its chosen token.

        Args:
            tokens: the token chosen for each row.
            live: False for rows that are finished (they take nothing), or None for all rows live.

        Raises:
            ValueError: a row's token is not allowed by its state (``ConstraintState.advance``).

        Shapes: tokens ``(B,)``, live ``(B,)`` bool.
        """
        alive = [True] * len(self.states) if live is None else live.tolist()
        for state, token, ok in zip(self.states, tokens.tolist(), alive, strict=True):
            if state is not None and ok:
                state.advance(token)


def row_constraints(constraint: Any, rows: int, tokenizer: Any, vocab_size: int, eos: int | None
                    ) -> RowConstraints | None:
    """The ``RowConstraints`` of a ``generate`` call: ``constraint`` is None, one constraint for every row, or a
    list with one constraint (or None) per row.

    Args:
        constraint: None, a ``Constraint`` (or ``CompiledConstraint``) for every row, or a list with one per row.
        rows: the batch size.
        tokenizer: the model's tokenizer (needed to compile).
        vocab_size: the model's number of logits.
        eos: the token that ends a complete output.

    Returns:
        The rows' states over one bitmask, or None without a constraint.

    Raises:
        ValueError: a list of the wrong length, no tokenizer, or as ``compile_constraint``.
    """
    if constraint is None:
        return None
    per_row = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * rows
    if len(per_row) != rows:
        raise ValueError(f"constraint has {len(per_row)} entries for {rows} rows; expected one, or one per row")
    if tokenizer is None and any(c is not None and not isinstance(c, CompiledConstraint) for c in per_row):
        raise ValueError("constraint needs the model's tokenizer (model.tokenizer, or tokenizer=...)")
    compiled = {c: compile_constraint(c, tokenizer, vocab_size, eos) for c in set(per_row) if c is not None}
    return RowConstraints([None if c is None else compiled[c].start() for c in per_row], vocab_size)
