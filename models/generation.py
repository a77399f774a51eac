"""Generation: decoding loops for the three model families (mixed into the model classes).

- ``DecoderLM.generate`` / ``stream``: greedy or sampled continuation of (left-padded) prompts, with a KV cache,
  so every step runs the model on one new token per row. The cache starts with room for the prompt and up to
  ``CACHE_CHUNK`` new tokens and doubles when full: a large ``max_new_tokens`` costs memory only for the tokens
  really generated (a row may stop at EOS long before).
- ``Seq2SeqTransformer.generate``: beam search with the GNMT length penalty (paper §6.1), or greedy/sampled
  decoding with ``num_beams=1``; the source is encoded once and its cross-attention keys/values are computed
  at the first step and reused.
- ``EncoderLM.fill_mask`` / ``fill_mask_text``: the most likely tokens at ``[MASK]`` positions.

Every loop runs under ``torch.inference_mode()`` with the model switched to eval mode (dropout off) while it
computes; the training flags are restored afterwards (for ``stream``, after each token: between tokens the model
is as the caller left it, so interleaved streams cannot leave it in eval mode). Returned tensors are ordinary
tensors (not inference tensors), so they can feed a later training step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from blocks.kv_cache import KVCache, LayerCache

from .base import new_caches
from .beam_search import beam_search, gnmt_length_penalty
from .sampling import SamplingParams, seen_tokens


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


@dataclasses.dataclass
class _LMRequest:
    """A validated ``DecoderLM.generate`` request."""

    prompt: Tensor  # (B, L), L >= 1
    mask: Tensor | None  # (B, L) bool, None when nothing is padded
    max_new_tokens: int
    params: SamplingParams
    eos: int | None
    pad: int
    generator: torch.Generator | None


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


# ---------------------------------------------------------------------------------------------------------------
# DecoderLM
# ---------------------------------------------------------------------------------------------------------------


class DecoderLMGenerationMixin:
    """``generate`` and ``stream`` for ``DecoderLM``."""

    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | None = CONFIG_DEFAULT,
        pad_token_id: int | None = CONFIG_DEFAULT,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue each prompt by up to ``max_new_tokens`` tokens.

        Prompts of different lengths are left-padded and come with an ``attention_mask``; positions count real
        tokens only, so each row gets the tokens it would get alone. A row stops at its first EOS and is padded
        with ``pad_token_id`` after it; generation ends when every row has stopped or after ``max_new_tokens``.

        Args:
            input_ids: ``(B, L)`` prompt ids; ``L = 0`` starts every row from ``config.bos_token_id`` (which
                then appears in the output as the prompt).
            attention_mask: ``(B, L)`` bool or 0/1, True = real token; padding must be on the left.
            max_new_tokens: the most tokens to add (>= 0).
            do_sample: sample from the distribution instead of taking the arg-max.
            temperature: logits are divided by it before sampling (> 0 when sampling).
            top_k: sample among the k most likely tokens only.
            top_p: sample from the smallest set of tokens holding probability ``top_p`` (in (0, 1]).
            repetition_penalty: CTRL's penalty (> 0) on tokens already in the row, prompt included.
            eos_token_id: stop token (default ``config.eos_token_id``; None disables stopping).
            pad_token_id: written after a row's EOS (default ``config.pad_token_id``, else the EOS id).
            generator: the random generator for sampling, for reproducible samples.

        Returns:
            ``(B, L + n)`` long: the prompt followed by the ``n <= max_new_tokens`` generated positions.

        Raises:
            ValueError: bad ids or mask, right padding, ``temperature <= 0`` with sampling, ``top_p`` outside
                (0, 1], ``top_k < 1``, ``repetition_penalty <= 0``, token ids outside the vocabulary, or a
                prompt + ``max_new_tokens`` longer than learned positions can represent (``max_len``).

        Shapes: ``input_ids (B, L)`` -> ``(B, L + n)``.
        """
        request = self._lm_request(
            input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
            eos_token_id, pad_token_id, generator,
        )
        # Tokens are collected, not written into a (B, L + max_new_tokens) buffer: generation may stop at EOS
        # long before max_new_tokens, which may be huge.
        with _eval_mode(self):
            tokens = [step.tokens for step in self._lm_steps(request)]
        # Built outside inference mode: the result must stay usable in autograd (e.g. as training input).
        return torch.cat([request.prompt, *(t[:, None] for t in tokens)], dim=1)

    def stream(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | None = CONFIG_DEFAULT,
        pad_token_id: int | None = CONFIG_DEFAULT,
        generator: torch.Generator | None = None,
    ) -> Iterator[Tensor]:
        """Like ``generate``, but yield each step's tokens as soon as they are chosen.

        The arguments are checked when ``stream`` is called. Each step runs in eval mode, and the model's
        training flags are restored before each token is yielded: between tokens the model is as the caller left
        it, whatever other streams are open.

        Returns:
            An iterator of ``(B,)`` long tensors, one per generated position (``pad_token_id`` for rows that
            have stopped); stacking them along dim 1 gives ``generate(...)[:, L:]``.

        Raises:
            ValueError: as ``generate``.
        """
        request = self._lm_request(
            input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
            eos_token_id, pad_token_id, generator,
        )
        return (step.tokens.clone() for step in _each_step_in_eval_mode(self, self._lm_steps(request)))

    def _lm_request(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        max_new_tokens: int,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        repetition_penalty: float | None,
        eos_token_id: int | None,
        pad_token_id: int | None,
        generator: torch.Generator | None,
    ) -> _LMRequest:
        """Check every argument before any computation and resolve the defaults."""
        config = self.config
        self.check_ids(input_ids, "input_ids")
        b, length = input_ids.shape
        mask = self.check_mask(attention_mask, (b, length), "attention_mask")
        _check_count(max_new_tokens, "max_new_tokens")
        params = SamplingParams(do_sample, temperature, top_k, top_p, repetition_penalty)
        eos, pad = _resolve_eos_pad(eos_token_id, pad_token_id, config)
        _check_generator(generator, input_ids.device)
        if length == 0:
            bos = config.bos_token_id
            if bos is None:
                raise ValueError("the prompt is empty (L=0) and config.bos_token_id is None; give a prompt")
            input_ids = torch.full((b, 1), bos, dtype=torch.long, device=input_ids.device)
            mask = None
        if mask is not None:
            if not bool(mask[:, -1].all()):
                rows = (~mask[:, -1]).nonzero().flatten().tolist()
                raise ValueError(
                    f"attention_mask rows {rows} end in padding; pad prompts on the left so that new tokens "
                    "follow the last real token"
                )
            if bool(mask.all()):
                mask = None  # nothing padded: the unmasked path is cheaper at every step
        longest = input_ids.shape[1] if mask is None else int(mask.sum(dim=-1).max())
        capacity = self.positional.max_positions
        if capacity is not None and longest + max_new_tokens > capacity:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {longest + max_new_tokens} "
                f"positions, but the model's {self.config.positional} positions go up to max_len={capacity}"
            )
        return _LMRequest(input_ids, mask, max_new_tokens, params, eos, pad, generator)

    @torch.inference_mode()
    def _lm_steps(self, request: _LMRequest) -> Iterator[_Step]:
        """Prefill the prompt into a cache, then decode one token per row per step (the caller sets eval mode)."""
        if request.max_new_tokens == 0:
            return
        prompt, mask = request.prompt, request.mask
        b, length = prompt.shape
        # Positions ever cached: the prompt and the generated tokens (the last one is not fed back, but a spare
        # position costs little and keeps the size the plain prompt + max_new_tokens).
        limit = length + request.max_new_tokens
        cache = new_caches(len(self.layers), min(limit, length + CACHE_CHUNK))
        mask_buffer = None
        if mask is not None:
            # The mask of every step is a prefix of one buffer: generated tokens are always real.
            mask_buffer = torch.ones((b, cache[0].self_attn.max_len), dtype=torch.bool, device=mask.device)
            mask_buffer[:, :length] = mask
        logits = self(prompt, attention_mask=mask, cache=cache, logits_to_keep=1).logits[:, -1]
        filled = length

        def step(tokens: Tensor) -> Tensor:
            nonlocal filled, mask_buffer
            _make_room(cache, 1, limit)
            filled += 1
            step_mask = None
            if mask_buffer is not None:
                if mask_buffer.shape[1] < filled:
                    mask_buffer = torch.cat([mask_buffer, torch.ones_like(mask_buffer)], dim=1)
                step_mask = mask_buffer[:, :filled]
            return self(tokens[:, None], attention_mask=step_mask, cache=cache).logits[:, -1]

        seen = seen_tokens(prompt, mask, self.config.vocab_size) if request.params.uses_history else None
        yield from _token_loop(
            logits, step, request.params, request.generator, request.eos, request.pad, request.max_new_tokens, seen
        )


# ---------------------------------------------------------------------------------------------------------------
# Seq2SeqTransformer
# ---------------------------------------------------------------------------------------------------------------


class Seq2SeqGenerationMixin:
    """``generate`` (beam search / greedy) for ``Seq2SeqTransformer``."""

    def generate(
        self,
        src_ids: Tensor,
        src_mask: Tensor | None = None,
        max_new_tokens: int | None = None,
        num_beams: int = 4,
        length_penalty: float = 0.6,
        *,
        early_stopping: bool = True,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | None = CONFIG_DEFAULT,
        pad_token_id: int | None = CONFIG_DEFAULT,
        decoder_start_token_id: int | None = CONFIG_DEFAULT,
        generator: torch.Generator | None = None,
        return_scores: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Translate each source: beam search as in the paper (§6.1: 4 beams, length penalty 0.6, at most
        source length + 50 tokens), or greedy/sampled decoding with ``num_beams=1``.

        Beam search ranks hypotheses by ``log P(Y|X) / ((5 + |Y|) / 6) ** length_penalty`` (GNMT) and stops a
        source as soon as all its beams have ended, i.e. no live beam can still beat its best finished
        hypothesis (which never changes the result); see ``models.beam_search.beam_search``.

        Args:
            src_ids: ``(B, S)`` source ids, ``S >= 1``.
            src_mask: ``(B, S)`` bool or 0/1, True = real token (any padding side).
            max_new_tokens: the most tokens after the start token (default: the longest source's real length
                + 50, capped at what learned decoder positions can represent).
            num_beams: beams per source (>= 1; 1 is greedy or sampling).
            length_penalty: the GNMT ``alpha``.
            early_stopping: stop each source early when possible (False: decode to ``max_new_tokens``).
            do_sample, temperature, top_k, top_p, repetition_penalty, generator: as ``DecoderLM.generate``;
                with ``num_beams=1`` only.
            eos_token_id: end token (default ``config.eos_token_id``; None: run to ``max_new_tokens``).
            pad_token_id: written after EOS (default ``config.pad_token_id``, else the EOS id).
            decoder_start_token_id: first decoder input (default ``config.decoder_start_token_id``).
            return_scores: also return each output's length-normalised log-probability (the beam score; for
                ``num_beams=1`` the same formula on the model's log-probabilities).

        Returns:
            ``(B, 1 + T)`` long target ids starting with the decoder start token (and ``(B,)`` float scores
            with ``return_scores``).

        Raises:
            ValueError: bad ids or masks, ``num_beams < 1``, sampling or a repetition penalty with
                ``num_beams > 1``, ``temperature <= 0`` with sampling, ``top_p`` outside (0, 1], token ids
                outside the vocabulary, or ``1 + max_new_tokens`` beyond learned decoder positions.

        Shapes: ``src_ids (B, S)`` -> ``(B, 1 + T)``, ``T <= max_new_tokens``.
        """
        config = self.config
        self.check_ids(src_ids, "src_ids")
        b, src_len = src_ids.shape
        if src_len == 0:
            raise ValueError("src_ids is empty (S=0); give at least one source token")
        src_mask = self.check_mask(src_mask, (b, src_len), "src_mask")
        if isinstance(num_beams, bool) or not isinstance(num_beams, numbers.Integral) or num_beams < 1:
            raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
        if not isinstance(length_penalty, numbers.Real) or not math.isfinite(length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
        if not isinstance(early_stopping, bool):
            raise ValueError(f"early_stopping must be True or False, got {early_stopping!r}")
        params = SamplingParams(do_sample, temperature, top_k, top_p, repetition_penalty)
        if num_beams > 1 and (params.do_sample or params.uses_history):
            raise ValueError(
                f"do_sample and repetition_penalty work with num_beams=1 only, got num_beams={num_beams} "
                f"with do_sample={do_sample}, repetition_penalty={repetition_penalty}"
            )
        eos, pad = _resolve_eos_pad(eos_token_id, pad_token_id, config)
        start = _resolve_token(decoder_start_token_id, config.decoder_start_token_id, "decoder_start_token_id",
                               config.vocab_size)
        if start is None:
            raise ValueError("decoder_start_token_id is None (and so is config.decoder_start_token_id)")
        _check_generator(generator, src_ids.device)
        capacity = self.decoder_positional.max_positions
        if max_new_tokens is None:
            longest = src_len if src_mask is None else int(src_mask.sum(dim=-1).max())
            max_new_tokens = longest + 50  # §6.1
            if capacity is not None:
                max_new_tokens = min(max_new_tokens, capacity - 1)
        else:
            _check_count(max_new_tokens, "max_new_tokens")
            if capacity is not None and 1 + max_new_tokens > capacity:
                raise ValueError(
                    f"1 start token + max_new_tokens={max_new_tokens} = {1 + max_new_tokens} target positions, "
                    f"but the decoder's {config.positional} positions go up to max_len={capacity}"
                )
        if src_mask is not None and bool(src_mask.all()):
            src_mask = None
        if max_new_tokens == 0:  # nothing to decode: the start token alone, log P = 0
            sequences = torch.full((b, 1), start, dtype=torch.long, device=src_ids.device)
            scores = torch.zeros(b, device=src_ids.device)
            return (sequences, scores) if return_scores else sequences

        with torch.inference_mode(), _eval_mode(self):
            memory = self.encode(src_ids, src_mask)  # (B, S, d_model), once per source
            if num_beams == 1:
                sequences, scores = self._greedy(
                    memory, src_mask, start, max_new_tokens, params, generator, eos, pad, length_penalty
                )
            else:
                step = self._beam_step(memory, src_mask, max_new_tokens)
                found = beam_search(
                    step, batch_size=b, start_token_id=start, num_beams=num_beams, max_new_tokens=max_new_tokens,
                    eos_token_id=eos, pad_token_id=pad, length_penalty=float(length_penalty),
                    early_stopping=early_stopping, device=src_ids.device,
                )
                first = torch.full((b, 1), start, dtype=torch.long, device=src_ids.device)
                sequences, scores = torch.cat([first, found.sequences], dim=1), found.scores
        # Clones leave inference mode, so the outputs can be used in autograd later.
        return (sequences.clone(), scores.clone()) if return_scores else sequences.clone()

    def _greedy(
        self,
        memory: Tensor,
        src_mask: Tensor | None,
        start: int,
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: int | None,
        pad: int,
        alpha: float,
    ) -> tuple[Tensor, Tensor]:
        """Greedy or sampled decoding with a cache; returns ``(ids (B, 1 + T), normalised scores (B,))``."""
        b = memory.shape[0]
        first = torch.full((b, 1), start, dtype=torch.long, device=memory.device)
        log_prob = torch.zeros(b, device=memory.device)
        lengths = torch.zeros(b, dtype=torch.long, device=memory.device)
        cache = new_caches(len(self.decoder_layers), min(max_new_tokens, CACHE_CHUNK), cross=True)
        logits = self.decode(memory, first, src_mask, cache=cache)[:, -1]

        def step(tokens: Tensor) -> Tensor:
            _make_room(cache, 1, max_new_tokens)
            return self.decode(memory, tokens[:, None], src_mask, cache=cache)[:, -1]

        seen = seen_tokens(first, None, self.config.vocab_size) if params.uses_history else None
        out = [first]
        for s in _token_loop(logits, step, params, generator, eos, pad, max_new_tokens, seen):
            out.append(s.tokens[:, None])
            chosen = torch.log_softmax(s.logits.float(), dim=-1).gather(1, s.tokens[:, None]).squeeze(1)
            live = torch.ones_like(lengths, dtype=torch.bool) if s.live is None else s.live
            log_prob += torch.where(live, chosen, 0.0)
            lengths += live.long()
        return torch.cat(out, dim=1), log_prob / gnmt_length_penalty(lengths.float(), alpha)

    def _beam_step(
        self, memory: Tensor, src_mask: Tensor | None, max_new_tokens: int
    ) -> Callable[[Tensor, Tensor | None, bool], Tensor]:
        """The ``beam_search`` step over a cached decoder (see ``models.beam_search.StepFn``)."""
        # The start token and every generated token but the last are cached: max_new_tokens positions at most.
        cache = new_caches(len(self.decoder_layers), min(max_new_tokens, CACHE_CHUNK), cross=True)
        state = {"memory": memory, "mask": src_mask}

        def step(tokens: Tensor, parents: Tensor | None, sources_changed: bool) -> Tensor:
            _make_room(cache, tokens.shape[1], max_new_tokens)
            if parents is not None:
                for layer_cache in cache:
                    layer_cache.self_attn.reorder(parents)
                    # Beams of one source share their cross-attention keys/values: reindex them only when
                    # the rows change sources (expansion to beams, or finished sources leaving).
                    if sources_changed:
                        layer_cache.cross_attn.reorder(parents)
                if sources_changed:
                    state["memory"] = state["memory"].index_select(0, parents)
                    if state["mask"] is not None:
                        state["mask"] = state["mask"].index_select(0, parents)
            return self.decode(state["memory"], tokens, state["mask"], cache=cache)[:, -1]

        return step


# ---------------------------------------------------------------------------------------------------------------
# EncoderLM
# ---------------------------------------------------------------------------------------------------------------


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
        self.check_ids(input_ids, "input_ids")
        mask = self.check_mask(attention_mask, tuple(input_ids.shape), "attention_mask")
        if mask_token_id is None:
            mask_token_id = config.mask_token_id
        mask_id = _resolve_token(mask_token_id, None, "mask_token_id", config.vocab_size)
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
        with torch.inference_mode(), _eval_mode(self):
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


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------------


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
