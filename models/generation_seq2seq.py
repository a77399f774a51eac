"""``Seq2SeqTransformer.generate``: beam search (GNMT length penalty, paper §6.1) or greedy/sampled decoding.

The source is encoded once and its cross-attention keys/values are computed at the first step and reused. With
``compile=True`` the decoder steps after the first run one compiled static-shape graph
(``models.generation_seq2seq_compiled``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from . import generation as _shared
from .beam_search import beam_search, gnmt_length_penalty
from .generation import (
    CONFIG_DEFAULT,
    QuantizeMixin,
    _check_count,
    _check_generator,
    _eval_mode,
    _make_room,
    _resolve_eos_pad,
    _resolve_token,
    _sampling_params,
    _token_loop,
)
from .sampling import SamplingParams, seen_tokens


class Seq2SeqGenerationMixin(QuantizeMixin):
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
        sampling: SamplingParams | None = None,
        compile: bool = False,  # noqa: A002 - the name torch uses for this switch
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
            sampling: the sampling settings as one ``SamplingParams`` (instead of the separate keywords).
            return_scores: also return each output's length-normalised log-probability (the beam score; for
                ``num_beams=1`` the same formula on the model's log-probabilities).
            compile: decode with a compiled static-shape step (``models.generation_seq2seq_compiled``): the
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
        params = _sampling_params(sampling, do_sample, temperature, top_k, top_p, repetition_penalty)
        if num_beams > 1 and (params.do_sample or params.uses_history):
            raise ValueError(
                f"do_sample and repetition_penalty work with num_beams=1 only, got num_beams={num_beams} "
                f"with do_sample={params.do_sample}, repetition_penalty={params.repetition_penalty}"
            )
        eos, pad = _resolve_eos_pad(eos_token_id, pad_token_id, config)
        start = _resolve_token(decoder_start_token_id, config.decoder_start_token_id, "decoder_start_token_id",
                               config.vocab_size)
        if start is None:
            raise ValueError("decoder_start_token_id is None (and so is config.decoder_start_token_id)")
        _check_generator(generator, src_ids.device)
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        if compile:
            from .generation_seq2seq_compiled import check_compilable

            check_compilable(self)
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
                    memory, src_mask, start, max_new_tokens, params, generator, eos, pad, length_penalty, compile
                )
            else:
                if compile:
                    from .generation_seq2seq_compiled import beam_step

                    step = beam_step(self, memory, src_mask, max_new_tokens, num_beams)
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
        compile: bool = False,  # noqa: A002
    ) -> tuple[Tensor, Tensor]:
        """Greedy or sampled decoding with a cache; returns ``(ids (B, 1 + T), normalised scores (B,))``."""
        b = memory.shape[0]
        first = torch.full((b, 1), start, dtype=torch.long, device=memory.device)
        log_prob = torch.zeros(b, device=memory.device)
        lengths = torch.zeros(b, dtype=torch.long, device=memory.device)
        if compile:
            from .generation_seq2seq_compiled import greedy_step

            logits, step = greedy_step(self, memory, src_mask, start, max_new_tokens)
        else:
            cache = _shared.new_caches(len(self.decoder_layers), min(max_new_tokens, _shared.CACHE_CHUNK),
                                       cross=True)
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
        cache = _shared.new_caches(len(self.decoder_layers), min(max_new_tokens, _shared.CACHE_CHUNK), cross=True)
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

