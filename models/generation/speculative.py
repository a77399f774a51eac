"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding").

A small draft model proposes ``k`` tokens one at a time; the target model scores all of them in one forward pass
and keeps a prefix: draft token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))`` (p: target,
q: draft); at the first rejection a token is drawn from ``norm(max(0, p_i - q_i))`` instead, and when all ``k`` are
accepted one more is drawn from ``p_{k+1}`` (§2.3, Algorithm 1). Every emitted token then follows the target's
distribution exactly (Appendix A.1), so a round emits between 1 and ``k + 1`` tokens for one target pass. Greedy
decoding is the limit where p and q are one-hot: a draft token is kept iff it is the target's arg-max.

Both models keep a KV cache; rejected positions are dropped by rolling the caches' fill length back (the cache
buffers are written in place, so the stale entries are simply overwritten later). A round costs k one-token draft
steps and one target pass over k + 1 tokens; on a CPU both are dispatch-bound (a one-token step of a 1-layer draft
costs a fifth of the 4-layer target's, not the ratio of their weights), so ``compile=True`` runs the draft's
one-token step as the compiled static-shape step of ``models.generation.compiled`` over a bucket cache, where
rolling back hides the dropped slots in the cache's mask. ``python -m benchmarks.speculative`` measures the
acceptance rate and the speed-up on the demo model.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from typing import Any

import torch
from torch import Tensor

from ..core import stack
from ..core.base import ZooModel
from . import steps  # steps.CACHE_CHUNK is read at call time (tests patch it)
from .compiled import bucket_buffers, compile_step, first_bucket, grown_bucket, next_token_logits, release_buffers
from .constraints import ConstraintState, apply_bitmask, new_bitmask
from .requests import CONFIG_DEFAULT, LMRequest, check_compilable, check_count, check_flag, lm_request
from .sampling import SamplingParams, nan_rows, raise_nan_logits
from .steps import eval_mode, make_room


@dataclasses.dataclass
class SpeculativeOutput:
    """The result of ``speculative_decode``.

    Attributes:
        sequences: ``(1, L + n)`` long, the prompt and the generated tokens.
        proposed: draft tokens proposed over the whole call.
        accepted: draft tokens the target kept.
        rounds: target forward passes (each emits 1 to ``k + 1`` tokens).
    """

    sequences: Tensor
    proposed: int
    accepted: int
    rounds: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0


def verify_draft(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """The rejection rule of speculative sampling (Leviathan et al. 2023, Algorithm 1), for a batch of rounds.

    Args:
        target_probs: the target's distributions after the prefix and after each draft token.
        draft_probs: the draft's distributions the draft tokens were drawn from.
        draft_tokens: the proposed tokens.
        generator: the random generator of the acceptance draws and the resampling.

    Returns:
        ``(accepted, next_token)``: how many leading draft tokens each row keeps, and the token that follows them
        (drawn from the residual ``max(0, p - q)`` at the first rejection, or from ``p_{k+1}`` if all are kept).

    Shapes: target_probs ``(N, k + 1, V)``, draft_probs ``(N, k, V)``, draft_tokens ``(N, k)`` ->
        ``(N,)``, ``(N,)``.
    """
    n, k = draft_tokens.shape
    p = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)  # (N, k)
    q = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    u = torch.rand((n, k), generator=generator, device=draft_tokens.device)
    # u < p / q without the division (q > 0 for a drawn token, but p may be 0).
    rejected = u * q >= p
    # Tokens before the first rejection (k when every draft token is accepted).
    accepted = (~rejected).long().cumprod(1).sum(1)
    rows = torch.arange(n, device=draft_tokens.device)
    p_next = target_probs[rows, accepted]  # (N, V)
    padded_q = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # q_{k+1} = 0: sample p_{k+1}
    residual = (p_next - padded_q[rows, accepted]).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual; rejection then has probability 0, so p itself is a safe fallback.
    residual = torch.where(total > 0, residual, p_next)
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return accepted, next_token


def check_draft(target: Any, draft: Any, num_draft_tokens: Any, request: LMRequest) -> None:
    """Reject a draft model or request that speculative decoding cannot serve, before any work.

    Args:
        target: the model whose distribution the output follows.
        draft: the smaller model that proposes tokens.
        num_draft_tokens: the tokens the draft proposes per round.
        request: the checked request.

    Raises:
        ValueError: the draft is not a model of the target's kind (a ``DecoderLM``: a ``ZooModel`` with the
            target's config class), its vocabulary differs from the target's,
            ``num_draft_tokens`` is not an integer >= 1, the batch has more than one row or padding, a repetition
            penalty is asked for, or the draft's learned positions cannot hold the prompt + ``max_new_tokens``.
    """
    # A model of the target's kind: a ZooModel whose config is the target's config class (a DecoderLM's
    # DecoderLMConfig), so it takes a cache and ``logits_to_keep`` as the target does.
    if not isinstance(draft, ZooModel) or not isinstance(draft.config, type(target.config)):
        raise ValueError(f"draft_model must be a DecoderLM, got {type(draft).__name__}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft_model has vocab_size={draft.config.vocab_size}, the target has "
            f"{target.config.vocab_size}; speculative decoding needs one shared vocabulary"
        )
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, numbers.Integral) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
    if request.prompt.shape[0] != 1 or request.mask is not None:
        raise ValueError(
            f"speculative decoding takes one unpadded prompt (batch size 1), got batch size {request.prompt.shape[0]}"
            + (" with padding" if request.mask is not None else "")
        )
    if request.params.uses_history:
        raise ValueError(
            f"speculative decoding does not support repetition_penalty={request.params.repetition_penalty}"
        )
    if request.params.uses_counts:
        raise ValueError(
            f"speculative decoding does not support presence_penalty={request.params.presence_penalty} or "
            f"frequency_penalty={request.params.frequency_penalty}"
        )
    capacity = draft.positional.max_positions
    needed = request.prompt.shape[1] + request.max_new_tokens
    if capacity is not None and needed > capacity:
        raise ValueError(f"the draft model's positions go up to max_len={capacity}, the request needs {needed}")


class _EagerDraft:
    """The draft's next-token logits, run eagerly over a growing KV cache.

    ``logits(end)`` feeds ``ids[:, seen:end]`` — only the tokens the cache has not seen: the whole prompt at
    first, then one token per draft step (two after a round that accepted every proposal) — and returns the
    logits after ``ids[:, end - 1]``. ``rollback(n)`` forgets every position from ``n`` on.
    """

    def __init__(self, draft: Any, ids: Tensor, size: int, limit: int) -> None:
        self.draft, self.ids, self.limit = draft, ids, limit
        self.cache = stack.new_caches(len(draft.layers), size)

    def logits(self, end: int) -> Tensor:
        start = self.cache[0].self_attn.length
        make_room(self.cache, end - start, self.limit)
        return self.draft(self.ids[:, start:end], cache=self.cache, logits_to_keep=1).logits[:, -1]  # (1, V)

    def rollback(self, n: int) -> None:
        for layer_cache in self.cache:
            kv = layer_cache.self_attn
            kv.length = min(kv.length, n)


class _CompiledDraft:
    """``_EagerDraft``'s interface over the compiled static-shape one-token step of ``models.generation.compiled``.

    The prompt is prefilled eagerly (its logits serve the first proposal); every later token runs the compiled
    step over the draft's bucket cache, whose write slot and visible-slot mask are moved in place, so one graph
    serves every step, round and call of a bucket. Rolling back hides the dropped slots in the mask; they are
    overwritten when written again. The bucket starts with room for the prompt and ``steps.CACHE_CHUNK`` new tokens
    and doubles when full (``compiled.grown_bucket``), so memory follows the tokens drafted, not ``limit``.
    """

    def __init__(self, draft: Any, ids: Tensor, length: int, limit: int) -> None:
        self.draft, self.ids, self.limit = draft, ids, limit
        prefill = stack.new_caches(len(draft.layers), length)
        self.pending: Tensor | None = draft(ids[:, :length], cache=prefill, logits_to_keep=1).logits[:, -1]
        self.bucket = first_bucket(limit, length, draft.positional.max_positions)
        self.caches, self.mask, self.index = bucket_buffers(draft, prefill, 1, self.bucket, weakref.ref(self))
        self.mask.zero_()
        self.mask[:, :length] = True
        self.filled = length
        # A fixed input buffer: the graph sees the same tensor at every step, not a moving view of ``ids``.
        self.token = ids.new_empty((1, 1))
        self.run = compile_step(next_token_logits, draft, ids.device)
        self.checked = False  # the first compiled call of a decoding checks every guard (and may compile)

    def logits(self, end: int) -> Tensor:
        if self.pending is not None:
            logits, self.pending = self.pending, None
            return logits
        logits = None
        while self.filled < end:
            pos = self.filled
            if pos == self.bucket:
                self._grow()
            self.mask[:, pos] = True  # the new token's slot: visible from now on, and this step's write index
            self.index.fill_(pos)
            self.token.copy_(self.ids[:, pos : pos + 1])
            # Only this model's graph runs here, on the same buffers and shapes every step: the full guard check
            # is redundant after the first step (as in ``compiled_steps``).
            logits = self.run(self.draft, self.token, self.mask, self.caches, skip_guards=self.checked)
            self.checked = True
            self.filled += 1
        # Used before the next step runs (CUDA graphs overwrite their output buffer at the next replay).
        return logits

    def _grow(self) -> None:
        """Move the ``filled`` slots to the next bucket (its graph compiles at its first step)."""
        old_caches, old_mask = self.caches, self.mask
        self.bucket = grown_bucket(self.bucket, self.limit, self.draft.positional.max_positions)
        self.caches, self.mask, self.index = bucket_buffers(
            self.draft, old_caches, 1, self.bucket, weakref.ref(self), self.filled
        )
        self.mask.zero_()
        self.mask[:, : self.filled] = old_mask[:, : self.filled]
        release_buffers(self.draft, old_caches)
        self.checked = False  # new shapes: the next call checks every guard

    def rollback(self, n: int) -> None:
        if n < self.filled:
            self.mask[:, n:] = False
            self.filled = n


@torch.inference_mode()
def speculative_steps(target: Any, draft: Any, request: LMRequest, k: int, constraint: ConstraintState | None = None
                      ) -> SpeculativeOutput:
    """Run speculative decoding for a checked request (the caller sets eval mode on both models).

    ``constraint`` (``models.generation.constraints``): the draft proposes only tokens the constraint allows (its
    logits masked, the state advanced with each proposal); the target's logits at every checked position are masked
    with the state after the proposals before it, so the rule compares the two masked distributions and the output
    follows the target's masked distribution exactly; the state is rolled back past the rejected proposals.

    Every token lives in one preallocated ``(1, L + max_new_tokens)`` buffer: draft proposals are written after
    the accepted tokens and simply overwritten when rejected, so a round allocates no sequence and each model is
    fed a slice of the buffer — only the tokens its cache has not seen (the draft never re-runs accepted tokens:
    1 new token per draft step, 2 after a round that accepted everything). The target checks all proposals in
    one forward pass of ``k + 1`` tokens.

    Args:
        target: the model whose distribution the output follows.
        draft: the smaller model that proposes tokens.
        request: the checked one-row request.
        k: the most tokens the draft proposes per round.
        constraint: the row's constraint state, or None.

    Returns:
        The sequences (prompt and generated tokens) and the counts of proposed and accepted tokens and rounds.

    Raises:
        ValueError: the draft's or the target's next-token logits hold a NaN.
    """
    prompt, params, generator = request.prompt, request.params, request.generator
    length = prompt.shape[1]
    limit = length + request.max_new_tokens
    for model in (target, draft):
        steps.refuse_longrope_switch(model, length, limit, "speculative decoding")
    ids = prompt.new_empty((1, limit))
    ids[:, :length] = prompt
    size = min(limit, length + steps.CACHE_CHUNK)
    target_cache = stack.new_caches(len(target.layers), size)
    drafter = (_CompiledDraft(draft, ids, length, limit) if request.compile
               else _EagerDraft(draft, ids, size, limit))
    sample = params.do_sample
    # The draft distributions of one round, for the rejection rule (sampling only).
    draft_probs = ids.new_empty((1, k, target.config.vocab_size), dtype=torch.float32) if sample else None
    n = length  # tokens known: the prompt and the tokens emitted so far
    proposed = accepted = rounds = 0
    vocab = target.config.vocab_size
    masks = new_bitmask(k + 1, vocab) if constraint is not None else None  # the state's mask at each position

    while n < limit:
        # A round emits up to n_draft + 1 tokens; never propose past max_new_tokens.
        n_draft = min(k, limit - n - 1)
        for i in range(n_draft):
            logits = drafter.logits(n + i)  # (1, V)
            if bool(nan_rows(logits).any()):
                raise ValueError(
                    f"the draft model's next-token logits at position {n + i} are NaN; expected finite logits (the "
                    "draft's weights or inputs hold NaN or inf values)"
                )
            if masks is not None:
                constraint.fill(masks, i)
                logits = apply_bitmask(logits, masks[i:i + 1])
            if sample:
                q = params.probabilities(logits)
                draft_probs[:, i] = q
                ids[:, n + i] = torch.multinomial(q, 1, generator=generator)[:, 0]
            else:
                ids[:, n + i] = logits.argmax(-1)
            if constraint is not None:
                constraint.advance(int(ids[0, n + i]))
        # The target sees the last accepted token and every proposal: one forward pass of n_draft + 1 tokens.
        past = target_cache[0].self_attn.length
        make_room(target_cache, n + n_draft - past, limit)
        logits = target(ids[:, past : n + n_draft], cache=target_cache, logits_to_keep=n_draft + 1).logits[0]
        bad = nan_rows(logits)  # (n_draft + 1,): the target's distributions at each checked position
        if bool(bad.any()):
            raise_nan_logits(bad.new_ones(1), n - length + int(bad.nonzero()[0, 0]))  # batch 1: row 0
        if masks is not None:
            constraint.fill(masks, n_draft)  # after every proposal: the bonus position's mask
            logits = apply_bitmask(logits, masks[:n_draft + 1])
        if sample:
            p = params.probabilities(logits)
            if n_draft:
                n_ok_t, nxt = verify_draft(p[None], draft_probs[:, :n_draft], ids[:, n : n + n_draft], generator)
                n_ok = int(n_ok_t)
            else:
                n_ok, nxt = 0, torch.multinomial(p, 1, generator=generator)[0]
        else:
            # Greedy is the rejection rule with one-hot p and q: a proposal is kept iff it is the target's
            # arg-max, and the first disagreement (or the bonus position) takes the target's arg-max.
            best = logits.argmax(-1)  # (n_draft + 1,)
            n_ok = int((best[:n_draft] == ids[0, n : n + n_draft]).cumprod(0).sum())
            nxt = best[n_ok]
        ids[:, n + n_ok] = nxt
        if constraint is not None:
            constraint.rollback(n_draft - n_ok)
            constraint.advance(int(nxt))
        proposed += n_draft
        accepted += n_ok
        rounds += 1
        new = n_ok + 1
        if request.eos is not None:
            emitted = ids[0, n : n + new].tolist()
            if request.eos in emitted:
                n += emitted.index(request.eos) + 1
                break
        n += new
        # Keep in each cache only positions of tokens that stay (the newest token is fed in the next round).
        for layer_cache in target_cache:
            layer_cache.self_attn.length = n - 1
        drafter.rollback(n - 1)
    # Built outside inference mode: the result must stay usable in autograd, as plain generate's.
    with torch.inference_mode(False):
        sequences = ids[:, :n].clone()
    return SpeculativeOutput(sequences, proposed, accepted, rounds)


def speculative_decode(
    target: Any,
    draft: Any,
    input_ids: Tensor,
    max_new_tokens: int = 20,
    num_draft_tokens: int = 4,
    *,
    sampling: SamplingParams | None = None,
    eos_token_id: int | None = CONFIG_DEFAULT,
    generator: torch.Generator | None = None,
    compile: bool = False,  # noqa: A002 - the name torch uses for this switch
) -> SpeculativeOutput:
    """``target.generate(input_ids, draft_model=draft, ...)``, also returning the acceptance statistics.

    Args:
        target: the ``DecoderLM`` whose distribution the output follows.
        draft: a smaller ``DecoderLM`` with the same vocabulary.
        input_ids: ``(1, L)`` prompt ids.
        max_new_tokens: the most tokens to add.
        num_draft_tokens: tokens proposed per round (k >= 1).
        sampling: how tokens are chosen (default greedy).
        eos_token_id: stop token (default ``target.config.eos_token_id``).
        generator: the random generator for sampling.
        compile: run the draft's one-token steps with the compiled static-shape step of
            ``models.generation.compiled`` (the first call per draft model and cache bucket pays the compile). The
            target's verification pass stays eager: it sees 1 to k + 1 new tokens, a shape that changes.

    Returns:
        ``SpeculativeOutput``.

    Raises:
        ValueError: as ``DecoderLM.generate`` and ``check_draft`` (with ``compile``: a draft whose attention
            backend the compiled step does not support, or ``compile`` not a bool).

    Shapes: ``input_ids (1, L)`` -> ``sequences (1, L + n)``.
    """
    check_count(max_new_tokens, "max_new_tokens")
    request = lm_request(
        target, input_ids, None, max_new_tokens, False, 1.0, None, None, None, eos_token_id, CONFIG_DEFAULT,
        generator, sampling,
    )
    check_flag(compile, "compile")
    check_draft(target, draft, num_draft_tokens, request)
    if compile:
        check_compilable(draft)  # the draft is what compiles here, not the target
        request = dataclasses.replace(request, compile=True)
    with eval_mode(target), eval_mode(draft):
        return speculative_steps(target, draft, request, int(num_draft_tokens))
