"""``DecoderLM.generate`` / ``stream``: greedy or sampled continuation of (left-padded) prompts with a KV cache.

Every step runs the model on one new token per row. With ``compile=True`` the steps run the compiled static-shape
step of ``models.generation.compiled``; with a ``draft_model``, speculative decoding
(``models.generation.speculative``). See ``models.generation.steps`` for what the loops share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..core import stack
from . import steps  # steps.CACHE_CHUNK is read at call time (tests patch it)
from .compiled import compiled_steps
from .constraints import RowConstraints, row_constraints
from .requests import CONFIG_DEFAULT, LMRequest, check_compilable, lm_request
from .sampling import SamplingParams, seen_tokens
from .speculative import check_draft, speculative_steps
from .steps import Step, each_step_in_eval_mode, eval_mode, longrope_switch, make_room, token_loop


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
        *,
        sampling: SamplingParams | None = None,
        draft_model: DecoderLMGenerationMixin | None = None,
        num_draft_tokens: int = 4,
        compile: bool = False,  # noqa: A002 - the name torch uses for this switch
        constraint: Any = None,
        tokenizer: Any = None,
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
            sampling: all the sampling settings as one ``SamplingParams`` (instead of ``do_sample``,
                ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``; giving both is an error).
            draft_model: a smaller ``DecoderLM`` with the same vocabulary for speculative decoding (Leviathan et
                al. 2023): it proposes ``num_draft_tokens`` tokens, this model checks them in one forward pass.
                Greedy output is identical to plain greedy decoding; sampled output follows this model's
                distribution exactly. See ``models.generation.speculative``.
            num_draft_tokens: tokens the draft proposes per round (>= 1), with ``draft_model``.
            compile: decode with a compiled static-shape step over a bucketed cache
                (``models.generation.compiled``): the first call per model and bucket pays the compile, later
                calls and other prompt lengths of the bucket reuse the graph. With ``draft_model``, the draft's
                one-token steps compile (the verification pass of k + 1 tokens stays eager).
            constraint: a ``models.generation.constraints.Constraint`` (JSON schema, regex, grammar, choice) every
                row's output must match, or a list with one per row (None: that row is free): the logits of the
                tokens that cannot continue a match are masked at every step; a row ends with EOS once its match is
                complete (or after ``max_new_tokens``, unfinished). With ``draft_model``, the draft proposes only
                allowed tokens and the target checks them on its masked distribution.
            tokenizer: the tokenizer a ``constraint`` is compiled for (default ``self.tokenizer``).

        Returns:
            ``(B, L + n)`` long: the prompt followed by the ``n <= max_new_tokens`` generated positions.

        Raises:
            ValueError: bad ids or mask, right padding, ``temperature <= 0`` with sampling, ``top_p`` outside
                (0, 1], ``top_k < 1``, ``repetition_penalty <= 0``, token ids outside the vocabulary, or a
                prompt + ``max_new_tokens`` longer than learned positions can represent (``max_len``), or an invalid
                ``constraint``.

        Shapes: ``input_ids (B, L)`` -> ``(B, L + n)``.
        """
        request = lm_request(
            self, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
            eos_token_id, pad_token_id, generator, sampling, compile,
        )
        constraints = self._row_constraints(constraint, tokenizer, request)
        if draft_model is not None:
            check_draft(self, draft_model, num_draft_tokens, request)
            if compile:
                check_compilable(draft_model)  # the draft's one-token step is what compiles
            state = None if constraints is None else constraints.states[0]  # one row (check_draft)
            with eval_mode(self), eval_mode(draft_model):
                return speculative_steps(self, draft_model, request, int(num_draft_tokens), state).sequences
        # Tokens are collected, not written into a (B, L + max_new_tokens) buffer: generation may stop at EOS
        # long before max_new_tokens, which may be huge.
        with eval_mode(self):
            tokens = [step.tokens for step in self._lm_steps(request, constraints=constraints)]
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
        *,
        sampling: SamplingParams | None = None,
        compile: bool = False,  # noqa: A002 - the name torch uses for this switch
        constraint: Any = None,
        tokenizer: Any = None,
    ) -> Iterator[Tensor]:
        """Like ``generate``, but yield each step's tokens as soon as they are chosen.

        The arguments are checked when ``stream`` is called. Each step runs in eval mode, and the model's
        training flags are restored before each token is yielded: between tokens the model is as the caller left
        it, whatever other streams are open.

        Args:
            input_ids: prompt token ids, left-padded.
            attention_mask: True at real tokens, or None when nothing is padded.
            max_new_tokens: the most tokens to add (>= 0).
            do_sample: sample from the distribution instead of taking the arg-max.
            temperature: logits are divided by it before sampling (> 0 when sampling).
            top_k: sample among the k most likely tokens only.
            top_p: sample from the smallest set of tokens holding probability ``top_p`` (in (0, 1]).
            repetition_penalty: CTRL's penalty (> 0) on tokens already in the row, prompt included.
            eos_token_id: stop token (default ``config.eos_token_id``; None disables stopping).
            pad_token_id: written after a row's EOS (default ``config.pad_token_id``, else the EOS id).
            generator: the random generator for sampling, for reproducible samples.
            sampling: all the sampling settings as one ``SamplingParams`` (as ``generate``).
            compile: decode with the compiled static-shape step (as ``generate``).
            constraint: what each row's output must match (as ``generate``).
            tokenizer: the tokenizer a ``constraint`` is compiled for (default ``self.tokenizer``).

        Returns:
            An iterator of ``(B,)`` long tensors, one per generated position (``pad_token_id`` for rows that
            have stopped); stacking them along dim 1 gives ``generate(...)[:, L:]``.

        Raises:
            ValueError: as ``generate``.

        Shapes: ``input_ids (B, L)``, ``attention_mask (B, L)`` -> each item ``(B,)``.
        """
        request = lm_request(
            self, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty,
            eos_token_id, pad_token_id, generator, sampling, compile,
        )
        constraints = self._row_constraints(constraint, tokenizer, request)
        # The caller's code runs between the steps of a stream (it may change the model), so every compiled step
        # checks all of dynamo's guards.
        loop = self._lm_steps(request, steady=False, constraints=constraints)
        return (step.tokens.clone() for step in each_step_in_eval_mode(self, loop))

    def _row_constraints(self, constraint: Any, tokenizer: Any, request: LMRequest) -> RowConstraints | None:
        tokenizer = tokenizer if tokenizer is not None else getattr(self, "tokenizer", None)
        return row_constraints(constraint, request.prompt.shape[0], tokenizer, self.config.vocab_size, request.eos)

    @torch.inference_mode()
    def _lm_steps(self, request: LMRequest, steady: bool = True, constraints: RowConstraints | None = None
                  ) -> Iterator[Step]:
        """Prefill the prompt into a cache, then decode one token per row per step (the caller sets eval mode).

        ``steady``: nothing but this generator touches the model between steps (see ``compiled_steps``).
        """
        if request.compile:
            yield from compiled_steps(self, request, steady, constraints)
            return
        if request.max_new_tokens == 0:
            return
        prompt, mask = request.prompt, request.mask
        b, length = prompt.shape
        # Positions ever cached: the prompt and the generated tokens (the last one is not fed back, but a spare
        # position costs little and keeps the size the plain prompt + max_new_tokens).
        limit = length + request.max_new_tokens
        cache = stack.new_caches(self.layers, min(limit, length + steps.CACHE_CHUNK))
        mask_buffer = None
        if mask is not None:
            # The mask of every step is a prefix of one buffer: generated tokens are always real.
            mask_buffer = torch.ones((b, cache[0].self_attn.max_len), dtype=torch.bool, device=mask.device)
            mask_buffer[:, :length] = mask
        logits = self(prompt, attention_mask=mask, cache=cache, logits_to_keep=1).logits[:, -1]
        filled = length
        # LongRoPE switches every position to its long factors once a sequence passes `switch` positions: the cache
        # (rotated with the short ones) is then computed again from the tokens, as transformers does.
        switch = longrope_switch(self)
        history = None
        if switch is not None and length <= switch < limit:
            history = torch.empty((b, limit), dtype=prompt.dtype, device=prompt.device)
            history[:, :length] = prompt

        def step(tokens: Tensor) -> Tensor:
            nonlocal filled, mask_buffer, cache
            make_room(cache, 1, limit)
            filled += 1
            step_mask = None
            if mask_buffer is not None:
                if mask_buffer.shape[1] < filled:
                    mask_buffer = torch.cat([mask_buffer, torch.ones_like(mask_buffer)], dim=1)
                step_mask = mask_buffer[:, :filled]
            if history is not None:
                history[:, filled - 1] = tokens
                if filled == switch + 1:
                    cache = stack.new_caches(self.layers, min(limit, filled + steps.CACHE_CHUNK))
                    return self(history[:, :filled], attention_mask=step_mask, cache=cache,
                                logits_to_keep=1).logits[:, -1]
            return self(tokens[:, None], attention_mask=step_mask, cache=cache).logits[:, -1]

        seen = seen_tokens(prompt, mask, self.config.vocab_size) if request.params.uses_history else None
        yield from token_loop(
            logits, step, request.params, request.generator, request.eos, request.pad, request.max_new_tokens, seen,
            constraints,
        )

