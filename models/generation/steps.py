"""Generation: decoding loops for the three model families (mixed into the model classes), and what they share.

One module per family:

- ``models.generation_decoder`` — ``DecoderLM.generate`` / ``stream``: greedy or sampled continuation of
  (left-padded) prompts with a KV cache, speculative decoding with a draft model (``models.speculative``), and a
  compiled static-shape decode step (``models.generation_compiled``).
- ``models.generation_seq2seq`` — ``Seq2SeqTransformer.generate``: beam search with the GNMT length penalty
  (paper §6.1), or greedy/sampled decoding with ``num_beams=1``.
- ``models.generation_fill_mask`` — ``EncoderLM.fill_mask`` / ``fill_mask_text``.

How the next token is chosen is one frozen object, ``models.sampling.SamplingParams``: ``generate(...,
sampling=SamplingParams(do_sample=True, top_p=0.9))``; the separate keyword arguments (``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``) remain as a thin layer that builds it.

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
import numbers
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from blocks.kv_cache import KVCache, LayerCache

from .sampling import SamplingParams


class _ConfigDefault:
    """Marks a token-id argument left to the model's config (``None`` means "no such token")."""

    def __repr__(self) -> str:
        return "<config default>"


#: Default of the token-id arguments: take the value from ``model.config``.
CONFIG_DEFAULT: Any = _ConfigDefault()

#: New positions a decoding cache has room for at first; it doubles whenever it is full.
CACHE_CHUNK = 256

T = TypeVar("T")


@dataclasses.dataclass
class _Step:
    """One decoding step of a batch."""

    tokens: Tensor  # (B,) the chosen token of each row; pad for rows that had already finished
    logits: Tensor  # (B, V) the logits the token was chosen from
    live: Tensor | None  # (B,) bool, rows still generating before this step (None: all of them)



def _token_loop(
    logits: Tensor,
    step: Callable[[Tensor], Tensor],
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: int | None,
    pad: int,
    max_new_tokens: int,
    seen: Tensor | None,
) -> Iterator[_Step]:
    """Choose a token per row from ``logits``, yield it, feed it back through ``step`` for the next logits.

    Rows that have produced ``eos`` get ``pad`` from then on; the loop ends when every row has ended or after
    ``max_new_tokens`` tokens. ``seen`` (``(B, V)`` bool, for the repetition penalty) is updated in place.
    """
    b = logits.shape[0]
    finished = None if eos is None else torch.zeros(b, dtype=torch.bool, device=logits.device)
    rows = torch.arange(b, device=logits.device)
    for i in range(max_new_tokens):
        tokens = params.next_tokens(logits, seen, generator)
        live = None
        if finished is not None:
            live = ~finished
            tokens = tokens.masked_fill(finished, pad)
            finished = finished | (tokens == eos)
        yield _Step(tokens, logits, live)
        if i + 1 == max_new_tokens or (finished is not None and bool(finished.all())):
            return
        if seen is not None:
            seen[rows, tokens] = True
        logits = step(tokens)


def _make_room(caches: list[LayerCache], new: int, limit: int) -> None:
    """Grow the self-attention caches so that ``new`` more positions fit: at least double their size, at most
    ``limit`` positions (what the request can ever need), keeping what they hold.

    Caches grow here rather than being preallocated for the worst case, so memory follows the tokens really
    generated; doubling keeps the copies to O(total length) over a whole generation.
    """
    kv = caches[0].self_attn
    if kv.length + new <= kv.max_len:
        return
    size = min(limit, max(kv.length + new, 2 * kv.max_len))
    for layer_cache in caches:
        old, grown = layer_cache.self_attn, KVCache(size)
        if old.k is not None:
            grown.update(old.k[:, :, : old.length], old.v[:, :, : old.length])
        layer_cache.self_attn = grown


def _each_step_in_eval_mode(module: nn.Module, steps: Generator[T, None, None]) -> Iterator[T]:
    """Drive ``steps`` with ``module`` in eval mode while it computes, and as the caller left it between items.

    Holding eval mode across a ``yield`` would let two interleaved iterators restore each other's flags (the
    later one would restore the eval mode the first one set, for good).
    """
    done = object()
    try:
        while True:
            with _eval_mode(module):
                item = next(steps, done)
            if item is done:
                return
            yield item
    finally:
        steps.close()


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode (dropout off) for the duration; every submodule's own flag is restored afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _resolve_token(value: Any, default: int | None, name: str, vocab_size: int) -> int | None:
    """``value`` (or ``default`` for ``CONFIG_DEFAULT``) checked to be None or an id in the vocabulary."""
    if value is CONFIG_DEFAULT:
        value = default
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < vocab_size:
        raise ValueError(f"{name}={value!r} must be None or an id in [0, vocab_size={vocab_size})")
    return int(value)


def _resolve_eos_pad(eos_token_id: Any, pad_token_id: Any, config: Any) -> tuple[int | None, int]:
    """The stop id (None: never stop) and the id written after it (the pad id, else the EOS id)."""
    eos = _resolve_token(eos_token_id, config.eos_token_id, "eos_token_id", config.vocab_size)
    pad = _resolve_token(pad_token_id, config.pad_token_id, "pad_token_id", config.vocab_size)
    if pad is None:
        pad = eos if eos is not None else 0  # without an EOS no row ends early, so nothing is padded
    return eos, pad


def _check_count(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _check_generator(generator: Any, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device}, but the inputs are on {device}")


def _sampling_params(
    sampling: SamplingParams | None,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float | None,
) -> SamplingParams:
    """The one ``SamplingParams`` of a request: ``sampling`` itself, or one built from the keyword arguments.

    Raises:
        ValueError: ``sampling`` is not a ``SamplingParams``, or is given together with a keyword argument that
            differs from its default (two sources for one setting), or as ``SamplingParams``.
    """
    built = SamplingParams(do_sample, temperature, top_k, top_p, repetition_penalty)
    if sampling is None:
        return built
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
    if built != SamplingParams():
        changed = [f.name for f in dataclasses.fields(built) if getattr(built, f.name) != f.default]
        raise ValueError(f"give either sampling= or the keyword arguments {changed}, not both")
    return sampling
