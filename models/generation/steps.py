"""What every decoding loop shares: the step type, the token loop, cache growth and eval-mode handling.

The loops themselves live beside this module: ``models.generation.decoder`` (``DecoderLM.generate`` /
``stream``), ``models.generation.seq2seq`` (``Seq2SeqTransformer.generate`` / ``stream``),
``models.generation.compiled`` and ``models.generation.seq2seq_compiled`` (the compiled static-shape steps) and
``models.generation.speculative`` (speculative decoding with a draft model). Their requests are checked in
``models.generation.requests``.

A decoding cache starts with room for the prompt and up to ``CACHE_CHUNK`` new tokens and doubles when full: a
large ``max_new_tokens`` costs memory only for the tokens really generated.

Every loop runs under ``torch.inference_mode()`` with the model switched to eval mode (dropout off) while it
computes; the training flags are restored afterwards (for ``stream``, after each token: between tokens the model
is as the caller left it, so interleaved streams cannot leave it in eval mode). Returned tensors are ordinary
tensors (not inference tensors), so they can feed a later training step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator, Iterator
from typing import TypeVar

import torch
from torch import Tensor, nn

from blocks.kv_cache import KVCache, LayerCache

from .constraints import RowConstraints
from .sampling import SamplingParams, has_nan, nan_rows, raise_nan_logits

#: New positions a decoding cache has room for at first; it doubles whenever it is full.
CACHE_CHUNK = 256

T = TypeVar("T")

#: Device types where ``token_loop`` checks every step's logits for NaN before choosing (a host sync costs nothing
#: there); elsewhere the check after the prompt's logits rides on the loop's own sync.
NAN_CHECK_EVERY_STEP = ("cpu",)


@dataclasses.dataclass
class Step:
    """One decoding step of a batch.

    Attributes:
        tokens: ``(B,)`` the chosen token of each row; pad for rows that had already finished.
        logits: ``(B, V)`` the logits the token was chosen from.
        live: ``(B,)`` bool, the rows still generating before this step (None: all of them).
    """

    tokens: Tensor  # (B,) the chosen token of each row; pad for rows that had already finished
    logits: Tensor  # (B, V) the logits the token was chosen from
    live: Tensor | None  # (B,) bool, rows still generating before this step (None: all of them)


def token_loop(
    logits: Tensor,
    step: Callable[[Tensor], Tensor],
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: int | None,
    pad: int,
    max_new_tokens: int,
    seen: Tensor | None,
    constraints: RowConstraints | None = None,
) -> Iterator[Step]:
    """Choose a token per row from ``logits``, yield it, feed it back through ``step`` for the next logits.

    Rows that have produced ``eos`` get ``pad`` from then on; the loop ends when every row has ended or after
    ``max_new_tokens`` tokens. ``seen`` (``(B, V)`` bool, for the repetition penalty) is updated in place; the
    counts of the generated tokens (presence and frequency penalties) are kept here when ``params`` needs them.
    ``constraints`` (``models.generation.constraints``) masks its constrained rows' logits before each choice and
    takes the chosen tokens.

    Args:
        logits: the logits of the first token (from the prompt).
        step: maps the chosen tokens ``(B,)`` to the next logits ``(B, V)``.
        params: how each token is chosen.
        generator: the random generator of sampling, or None.
        eos: the stop token, or None to never stop early.
        pad: the token written in a row after its EOS.
        max_new_tokens: the most tokens to choose per row.
        seen: True where a token already occurs in the row (repetition penalty), updated in place; or None.
        constraints: per-row constraints on the tokens, or None.

    Yields:
        One ``Step`` per chosen token.

    Shapes: logits ``(B, V)``, seen ``(B, V)`` bool.

    Raises:
        ValueError: the logits a live row chooses from hold a NaN (NaN weights or inputs): checked before the
            first token, and on the CPU before every token; elsewhere at the sync the loop makes anyway (whether
            every row has ended) or at its end, so a stream off the CPU may yield a few tokens first.
    """
    b = logits.shape[0]
    finished = None if eos is None else torch.zeros(b, dtype=torch.bool, device=logits.device)
    rows = torch.arange(b, device=logits.device)
    # Off the CPU a check costs a host sync: after the prompt's logits, NaN is checked at the sync the loop makes
    # anyway (whether every row has ended), or at the end when there is none.
    check_every_step = logits.device.type in NAN_CHECK_EVERY_STEP
    pending = None
    counts = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device) if params.uses_counts else None
    for i in range(max_new_tokens):
        live = None if finished is None else ~finished
        if i == 0 or check_every_step:
            if has_nan(logits):  # any row; then only the rows still choosing count
                bad = nan_rows(logits, live)
                if bool(bad.any()):
                    raise_nan_logits(bad, i)
        else:
            bad = nan_rows(logits, live)
            pending = bad if pending is None else pending | bad
        choose_from = logits if constraints is None else constraints.mask(logits, live)
        tokens = params.next_tokens(choose_from, seen, generator, counts)
        if constraints is not None:
            constraints.advance(tokens, live)
        done = False
        if finished is not None:
            tokens = tokens.masked_fill(finished, pad)
            finished = finished | (tokens == eos)
            if pending is None:
                done = bool(finished.all())
            else:
                done, nan = torch.stack([finished.all(), pending.any()]).tolist()
                if nan:
                    raise_nan_logits(pending, i)
        yield Step(tokens, logits, live)
        if i + 1 == max_new_tokens or done:
            if pending is not None and bool(pending.any()):
                raise_nan_logits(pending, i)
            return
        if seen is not None:
            seen[rows, tokens] = True
        if counts is not None:
            counts[rows, tokens] += 1
        logits = step(tokens)


def longrope_switch(model: nn.Module) -> int | None:
    """The positions past which the model's LongRoPE switches to its long factors (None: no LongRoPE).

    Args:
        model: the model whose positional modules are read.

    Returns:
        The smallest switch point among its positional modules, or None.
    """
    positionals = [getattr(model, "positional", None), *getattr(model, "layer_positionals", {}).values()]
    switches = [p.switch_after for p in positionals if getattr(p, "switch_after", None) is not None]
    return min(switches) if switches else None


def refuse_longrope_switch(model: nn.Module, length: int, limit: int, what: str) -> None:
    """Raise when a decoding loop that cannot compute its cache again (``what``) would cross the LongRoPE switch:
    a prompt of ``length`` positions growing to ``limit``.

    Args:
        model: the model whose LongRoPE switch is read.
        length: the prompt's positions.
        limit: the positions the loop can grow to.
        what: the loop's name, for the message.

    Raises:
        ValueError: naming the switch and the way that works (eager ``generate``).
    """
    switch = longrope_switch(model)
    if switch is not None and length <= switch < limit:
        raise ValueError(
            f"{what} cannot cross the LongRoPE switch at {switch} positions (a prompt of {length} growing to "
            f"{limit}): every cached key would have to be rotated again with the long factors; use the eager "
            "generate (compile=False, no draft model), which computes the cache again at the switch"
        )


def make_room(caches: list[LayerCache], new: int, limit: int) -> None:
    """Grow the self-attention caches so that ``new`` more positions fit: at least double their size, at most
    ``limit`` positions (what the request can ever need), keeping what they hold.

    Caches grow here rather than being preallocated for the worst case, so memory follows the tokens really
    generated; doubling keeps the copies to O(total length) over a whole generation.

    Args:
        caches: the per-layer caches, whose ``self_attn`` caches are replaced by larger ones when full.
        new: how many positions must fit besides those held.
        limit: the most positions the request can ever need.
    """
    kv = caches[0].self_attn
    if kv.length + new <= kv.max_len:
        return
    size = min(limit, max(kv.length + new, 2 * kv.max_len))
    for layer_cache in caches:
        old = layer_cache.self_attn
        grown = type(old)(size) if isinstance(old, KVCache) else KVCache(size)  # keeps the kind (latent)
        if old.k is not None:
            grown.update(old.k[:, :, : old.length], old.v[:, :, : old.length])
        layer_cache.self_attn = grown


def each_step_in_eval_mode(module: nn.Module, steps: Generator[T, None, None]) -> Iterator[T]:
    """Drive ``steps`` with ``module`` in eval mode while it computes, and as the caller left it between items.

    Holding eval mode across a ``yield`` would let two interleaved iterators restore each other's flags (the
    later one would restore the eval mode the first one set, for good).

    Args:
        module: the module to switch to eval mode.
        steps: the generator to drive (closed at the end).

    Yields:
        The items of ``steps``.
    """
    done = object()
    try:
        while True:
            with eval_mode(module):
                item = next(steps, done)
            if item is done:
                return
            yield item
    finally:
        steps.close()


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode (dropout off) for the duration; every submodule's own flag is restored afterwards.

    Args:
        module: the module to switch to eval mode.

    Yields:
        Nothing: the body of the ``with`` block runs in eval mode.
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
