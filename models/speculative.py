"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding").

A small draft model proposes ``k`` tokens one at a time; the target model scores all of them in one forward pass
and keeps a prefix: draft token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))`` (p: target,
q: draft); at the first rejection a token is drawn from ``norm(max(0, p_i - q_i))`` instead, and when all ``k`` are
accepted one more is drawn from ``p_{k+1}`` (§2.3, Algorithm 1). Every emitted token then follows the target's
distribution exactly (Appendix A.1), so a round emits between 1 and ``k + 1`` tokens for one target pass. Greedy
decoding is the limit where p and q are one-hot: a draft token is kept iff it is the target's arg-max.

Both models keep a KV cache; rejected positions are dropped by rolling the caches' fill length back (the cache
buffers are written in place, so the stale entries are simply overwritten later).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import generation as _shared
from .generation import _check_count, _make_room
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .generation_decoder import _LMRequest


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


def check_draft(target: Any, draft: Any, num_draft_tokens: Any, request: _LMRequest) -> None:
    """Reject a draft model or request that speculative decoding cannot serve, before any work.

    Raises:
        ValueError: the draft is not a ``DecoderLM``, its vocabulary differs from the target's,
            ``num_draft_tokens`` is not an integer >= 1, the batch has more than one row or padding, a repetition
            penalty is asked for, or the draft's learned positions cannot hold the prompt + ``max_new_tokens``.
    """
    from .generation_decoder import DecoderLMGenerationMixin

    if not isinstance(draft, DecoderLMGenerationMixin):
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
    capacity = draft.positional.max_positions
    needed = request.prompt.shape[1] + request.max_new_tokens
    if capacity is not None and needed > capacity:
        raise ValueError(f"the draft model's positions go up to max_len={capacity}, the request needs {needed}")


@torch.inference_mode()
def speculative_steps(target: Any, draft: Any, request: _LMRequest, k: int) -> SpeculativeOutput:
    """Run speculative decoding for a checked request (the caller sets eval mode on both models)."""
    prompt, params, generator = request.prompt, request.params, request.generator
    limit = prompt.shape[1] + request.max_new_tokens
    caches = {
        "target": _shared.new_caches(len(target.layers), min(limit, prompt.shape[1] + _shared.CACHE_CHUNK)),
        "draft": _shared.new_caches(len(draft.layers), min(limit, prompt.shape[1] + _shared.CACHE_CHUNK)),
    }
    seq = prompt
    proposed = accepted_total = rounds = 0
    done = request.max_new_tokens == 0

    def run(model: Any, cache: list, tokens: Tensor, keep: int) -> Tensor:
        _make_room(cache, tokens.shape[1], limit)
        return model(tokens, cache=cache, logits_to_keep=keep).logits  # (1, keep, V)

    def distribution(logits: Tensor) -> Tensor:
        if params.do_sample:
            return params.probabilities(logits)
        # Greedy: the arg-max as a one-hot distribution, so the same rule keeps a draft token iff it is the
        # target's arg-max and otherwise emits the target's arg-max.
        scores = logits.float()
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()

    while not done:
        generated = seq.shape[1] - prompt.shape[1]
        # A round emits up to k + 1 tokens; never propose past max_new_tokens.
        n_draft = min(k, request.max_new_tokens - generated - 1)
        draft_tokens, draft_probs = [], []
        for _ in range(n_draft):
            cache = caches["draft"]
            fed = torch.cat([seq, *draft_tokens], dim=1)[:, cache[0].self_attn.length :]
            q = distribution(run(draft, cache, fed, 1)[:, -1])  # (1, V)
            token = torch.multinomial(q, 1, generator=generator) if params.do_sample else q.argmax(-1, keepdim=True)
            draft_tokens.append(token)
            draft_probs.append(q)
        cache = caches["target"]
        past = cache[0].self_attn.length
        fed = torch.cat([seq, *draft_tokens], dim=1)[:, past:]
        p = distribution(run(target, cache, fed, n_draft + 1))  # (1, n_draft + 1, V)
        if n_draft:
            drafts = torch.cat(draft_tokens, dim=1)  # (1, n_draft)
            n_ok, nxt = verify_draft(p, torch.stack(draft_probs, dim=1), drafts, generator)
            n_ok = int(n_ok)
            new = torch.cat([drafts[:, :n_ok], nxt[:, None]], dim=1)
        else:
            n_ok, drafts = 0, None
            new = (torch.multinomial(p[:, 0], 1, generator=generator) if params.do_sample
                   else p[:, 0].argmax(-1, keepdim=True))
        proposed += n_draft
        accepted_total += n_ok
        rounds += 1
        if request.eos is not None and bool((new == request.eos).any()):
            new = new[:, : int((new[0] == request.eos).nonzero()[0]) + 1]
            done = True
        seq = torch.cat([seq, new], dim=1)
        if seq.shape[1] - prompt.shape[1] >= request.max_new_tokens:
            done = True
        # Keep in each cache only positions of tokens that stay (the newest token is fed in the next round).
        for name in ("target", "draft"):
            for layer_cache in caches[name]:
                kv = layer_cache.self_attn
                kv.length = min(kv.length, seq.shape[1] - 1)
    return SpeculativeOutput(seq.clone(), proposed, accepted_total, rounds)


def speculative_decode(
    target: Any,
    draft: Any,
    input_ids: Tensor,
    max_new_tokens: int = 20,
    num_draft_tokens: int = 4,
    *,
    sampling: SamplingParams | None = None,
    eos_token_id: int | None = _shared.CONFIG_DEFAULT,
    generator: torch.Generator | None = None,
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

    Returns:
        ``SpeculativeOutput``.

    Raises:
        ValueError: as ``DecoderLM.generate`` and ``check_draft``.

    Shapes: ``input_ids (1, L)`` -> ``sequences (1, L + n)``.
    """
    _check_count(max_new_tokens, "max_new_tokens")
    request = target._lm_request(
        input_ids, None, max_new_tokens, False, 1.0, None, None, None, eos_token_id, _shared.CONFIG_DEFAULT,
        generator, sampling,
    )
    check_draft(target, draft, num_draft_tokens, request)
    with _shared._eval_mode(target), _shared._eval_mode(draft):
        return speculative_steps(target, draft, request, int(num_draft_tokens))
