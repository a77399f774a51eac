"""``Seq2SeqTransformer.generate`` / ``stream``: beam search (GNMT length penalty, paper §6.1) or greedy/sampled
decoding.

The source is encoded once and its cross-attention keys/values are computed at the first step and reused. With
``compile=True`` the decoder steps after the first run one compiled static-shape graph
(``models.generation.seq2seq_compiled``). ``stream`` yields the tokens of greedy/sampled decoding step by step;
beam search cannot stream (a beam's tokens may change until the search ends).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ..core import stack
from . import seq2seq_compiled, steps  # attributes read at call time (tests patch beam_step, CACHE_CHUNK)
from .beam_search import beam_search, gnmt_length_penalty
from .requests import CONFIG_DEFAULT, Seq2SeqRequest, check_flag, seq2seq_request
from .sampling import SamplingParams, seen_tokens
from .steps import Step, each_step_in_eval_mode, eval_mode, make_room, token_loop


class Seq2SeqGenerationMixin:
    """``generate`` (beam search / greedy) and ``stream`` (greedy) for ``Seq2SeqTransformer``."""

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
        sampling: SamplingParams | None = None,
        compile: bool = False,  # noqa: A002 - the name torch uses for this switch
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Translate each source: beam search as in the paper (§6.1: 4 beams, length penalty 0.6, at most
        source length + 50 tokens), or greedy/sampled decoding with ``num_beams=1``.

        Beam search ranks hypotheses by ``log P(Y|X) / ((5 + |Y|) / 6) ** length_penalty`` (GNMT) and stops a
        source as soon as all its beams have ended, i.e. no live beam can still beat its best finished
        hypothesis (which never changes the result); see ``models.generation.beam_search.beam_search``.

        Args:
            src_ids: ``(B, S)`` source ids, ``S >= 1``.
            src_mask: ``(B, S)`` bool or 0/1, True = real token (any padding side).
            max_new_tokens: the most tokens after the start token (default: the longest source's real length
                + 50, capped at what learned decoder positions can represent).
            num_beams: beams per source (>= 1; 1 is greedy or sampling).
            length_penalty: the GNMT ``alpha``.
            early_stopping: stop each source early when possible (False: decode to ``max_new_tokens``).
            do_sample: sample instead of greedy decoding, as ``DecoderLM.generate``; with ``num_beams=1`` only.
            temperature: as ``DecoderLM.generate``; with ``num_beams=1`` only.
            top_k: as ``DecoderLM.generate``; with ``num_beams=1`` only.
            top_p: as ``DecoderLM.generate``; with ``num_beams=1`` only.
            repetition_penalty: as ``DecoderLM.generate``; with ``num_beams=1`` only.
            generator: as ``DecoderLM.generate``; with ``num_beams=1`` only.
            eos_token_id: end token (default ``config.eos_token_id``; None: run to ``max_new_tokens``).
            pad_token_id: written after EOS (default ``config.pad_token_id``, else the EOS id).
            decoder_start_token_id: first decoder input (default ``config.decoder_start_token_id``).
            sampling: the sampling settings as one ``SamplingParams`` (instead of the separate keywords).
            return_scores: also return each output's length-normalised log-probability (the beam score; for
                ``num_beams=1`` the same formula on the model's log-probabilities).
            compile: decode with a compiled static-shape step (``models.generation.seq2seq_compiled``): the
                encoder and the start token's step run eagerly, every later step (and the beam reorder) runs one
                graph over bucketed caches. The first call per model, batch, beam count and bucket pays the
                compile; later calls, and other source and target lengths of the bucket, reuse the graph. Needs
                the ``"sdpa"`` or ``"math"`` attention backend.

        Returns:
            ``(B, 1 + T)`` long target ids starting with the decoder start token (and ``(B,)`` float scores
            with ``return_scores``).

        Raises:
            ValueError: bad ids or masks, ``num_beams < 1``, sampling or a repetition penalty with
                ``num_beams > 1``, ``temperature <= 0`` with sampling, ``top_p`` outside (0, 1], token ids
                outside the vocabulary, ``1 + max_new_tokens`` beyond learned decoder positions, ``compile`` not
                a bool, or ``compile=True`` with an attention backend other than ``"sdpa"``/``"math"``.

        Shapes: ``src_ids (B, S)`` -> ``(B, 1 + T)``, ``T <= max_new_tokens``.
        """
        if isinstance(num_beams, bool) or not isinstance(num_beams, numbers.Integral) or num_beams < 1:
            raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
        if not isinstance(length_penalty, numbers.Real) or not math.isfinite(length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
        check_flag(early_stopping, "early_stopping")
        request = seq2seq_request(
            self, src_ids, src_mask, max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
            eos_token_id, pad_token_id, decoder_start_token_id, generator, sampling, compile, num_beams,
        )
        b, device, start = request.src_ids.shape[0], request.src_ids.device, request.start
        if request.max_new_tokens == 0:  # nothing to decode: the start token alone, log P = 0
            sequences = torch.full((b, 1), start, dtype=torch.long, device=device)
            scores = torch.zeros(b, device=device)
            return (sequences, scores) if return_scores else sequences

        with torch.inference_mode(), eval_mode(self):
            memory = self.encode(request.src_ids, request.src_mask)  # (B, S, d_model), once per source
            if num_beams == 1:
                sequences, scores = self._greedy(memory, request, length_penalty)
            else:
                src_mask, max_new_tokens = request.src_mask, request.max_new_tokens
                if compile:
                    step = seq2seq_compiled.beam_step(self, memory, src_mask, max_new_tokens, num_beams)
                else:
                    step = self._beam_step(memory, src_mask, max_new_tokens)
                found = beam_search(
                    step, batch_size=b, start_token_id=start, num_beams=num_beams, max_new_tokens=max_new_tokens,
                    eos_token_id=request.eos, pad_token_id=request.pad, length_penalty=float(length_penalty),
                    early_stopping=early_stopping, device=device,
                )
                first = torch.full((b, 1), start, dtype=torch.long, device=device)
                sequences, scores = torch.cat([first, found.sequences], dim=1), found.scores
        # Clones leave inference mode, so the outputs can be used in autograd later.
        return (sequences.clone(), scores.clone()) if return_scores else sequences.clone()

    def stream(
        self,
        src_ids: Tensor,
        src_mask: Tensor | None = None,
        max_new_tokens: int | None = None,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | None = CONFIG_DEFAULT,
        pad_token_id: int | None = CONFIG_DEFAULT,
        decoder_start_token_id: int | None = CONFIG_DEFAULT,
        generator: torch.Generator | None = None,
        sampling: SamplingParams | None = None,
        compile: bool = False,  # noqa: A002 - the name torch uses for this switch
    ) -> Iterator[Tensor]:
        """Like ``generate(..., num_beams=1)`` (greedy or sampled decoding), but yield each step's tokens as soon
        as they are chosen.

        Beam search cannot stream: a beam's tokens may still change until the search ends, so there is no
        ``num_beams``. The arguments are checked when ``stream`` is called; nothing runs (not even the encoder)
        until the first token is asked for. Each step runs in eval mode under ``torch.inference_mode``, and the
        model's training flags are restored before each token is yielded: between tokens the model is as the
        caller left it, whatever other streams are open.

        Args:
            src_ids: as ``generate``.
            src_mask: as ``generate``.
            max_new_tokens: as ``generate``.
            do_sample: as ``generate``.
            temperature: as ``generate``.
            top_k: as ``generate``.
            top_p: as ``generate``.
            repetition_penalty: as ``generate``.
            eos_token_id: as ``generate``.
            pad_token_id: as ``generate``.
            decoder_start_token_id: as ``generate``.
            generator: as ``generate``.
            sampling: as ``generate``.
            compile: as ``generate``; every compiled step checks dynamo's guards (the caller's code runs
                between steps).

        Returns:
            An iterator of ``(B,)`` long tensors, one per generated position (``pad_token_id`` for rows that have
            ended); stacking them along dim 1 gives ``generate(..., num_beams=1)[:, 1:]``. It stops when every
            row has produced EOS or after ``max_new_tokens`` tokens.

        Raises:
            ValueError: as ``generate`` (bad ids or masks, sampling settings, token ids, ``max_new_tokens``,
                ``compile``), at the call.

        Shapes: ``src_ids (B, S)`` -> ``T`` tensors of shape ``(B,)``, ``T <= max_new_tokens``.
        """
        request = seq2seq_request(
            self, src_ids, src_mask, max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
            eos_token_id, pad_token_id, decoder_start_token_id, generator, sampling, compile,
        )
        loop = self._stream_steps(request)
        # Clones leave inference mode, so the tokens can be used in autograd later.
        return (step.tokens.clone() for step in each_step_in_eval_mode(self, loop))

    @torch.inference_mode()
    def _stream_steps(self, request: Seq2SeqRequest) -> Iterator[Step]:
        """Encode the sources, then the greedy/sampled steps (the caller sets eval mode)."""
        if request.max_new_tokens == 0:
            return
        memory = self.encode(request.src_ids, request.src_mask)
        # The caller's code runs between the steps of a stream (it may change the model), so every compiled step
        # checks all of dynamo's guards.
        yield from self._greedy_steps(memory, request, steady=False)

    def _greedy(self, memory: Tensor, request: Seq2SeqRequest, alpha: float) -> tuple[Tensor, Tensor]:
        """Greedy or sampled decoding with a cache; returns ``(ids (B, 1 + T), normalised scores (B,))``."""
        b = memory.shape[0]
        first = torch.full((b, 1), request.start, dtype=torch.long, device=memory.device)
        log_prob = torch.zeros(b, device=memory.device)
        lengths = torch.zeros(b, dtype=torch.long, device=memory.device)
        out = [first]
        for s in self._greedy_steps(memory, request):
            out.append(s.tokens[:, None])
            chosen = torch.log_softmax(s.logits.float(), dim=-1).gather(1, s.tokens[:, None]).squeeze(1)
            live = torch.ones_like(lengths, dtype=torch.bool) if s.live is None else s.live
            log_prob += torch.where(live, chosen, 0.0)
            lengths += live.long()
        return torch.cat(out, dim=1), log_prob / gnmt_length_penalty(lengths.float(), alpha)

    def _greedy_steps(self, memory: Tensor, request: Seq2SeqRequest, steady: bool = True) -> Iterator[Step]:
        """The greedy/sampled decoding steps over a cached decoder (``max_new_tokens >= 1``; the caller runs
        under ``torch.inference_mode`` in eval mode).

        ``steady``: nothing but this loop touches the model between steps (``generate``; not ``stream``), so
        compiled steps after the first may skip dynamo's guard checks (see ``greedy_step``).
        """
        b, max_new_tokens, src_mask = memory.shape[0], request.max_new_tokens, request.src_mask
        first = torch.full((b, 1), request.start, dtype=torch.long, device=memory.device)
        if request.compile:
            logits, step = seq2seq_compiled.greedy_step(
                self, memory, src_mask, request.start, max_new_tokens, steady=steady
            )
        else:
            cache = stack.new_caches(len(self.decoder_layers), min(max_new_tokens, steps.CACHE_CHUNK),
                                       cross=True)
            logits = self.decode(memory, first, src_mask, cache=cache)[:, -1]

            def step(tokens: Tensor) -> Tensor:
                make_room(cache, 1, max_new_tokens)
                return self.decode(memory, tokens[:, None], src_mask, cache=cache)[:, -1]

        seen = seen_tokens(first, None, self.config.vocab_size) if request.params.uses_history else None
        yield from token_loop(logits, step, request.params, request.generator, request.eos, request.pad,
                               max_new_tokens, seen)

    def _beam_step(
        self, memory: Tensor, src_mask: Tensor | None, max_new_tokens: int
    ) -> Callable[[Tensor, Tensor | None, bool], Tensor]:
        """The ``beam_search`` step over a cached decoder (see ``models.generation.beam_search.StepFn``)."""
        # The start token and every generated token but the last are cached: max_new_tokens positions at most.
        cache = stack.new_caches(len(self.decoder_layers), min(max_new_tokens, steps.CACHE_CHUNK), cross=True)
        state = {"memory": memory, "mask": src_mask}

        def step(tokens: Tensor, parents: Tensor | None, sources_changed: bool) -> Tensor:
            make_room(cache, tokens.shape[1], max_new_tokens)
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

