"""Engine requests: the arguments of ``Engine.generate`` / ``add_request`` checked before any computation, the
state of each running sample (``Sequence``) and what the engine hands back (``RequestOutput``, ``RequestDelta``).

Every per-request argument is one value for all prompts or a list with one value per prompt. ``stop`` is a stop
string, a stop token id, or a list mixing both; a list counts as one value per prompt only when each of its items
is None or itself a list/tuple (``stop=["\\n", "."]`` is two stop strings for every prompt).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence as Seq
from typing import Any

import torch

from models.generation.sampling import SamplingParams

#: Why a sample ended: a stop token/string or the model's EOS, ``max_tokens`` or the context, or ``abort``.
FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of a chosen token under the model (log-softmax of the raw logits, before sampling
    processors, as vLLM reports them) and the ``top`` most likely tokens with theirs.

    Attributes:
        token_id: the chosen token.
        logprob: its log-probability.
        top: token id -> log-probability of the most likely tokens (as many as the request asked).
    """

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt. With ``n > 1``, ``token_ids``, ``text``, ``finish_reason`` and ``logprobs`` are
    lists with one entry per sample.

    Attributes:
        request_id: the engine's id of the request.
        prompt_token_ids: the prompt's ids.
        token_ids: the new tokens (a stop token is included; the text of a stop string is not).
        text: the new tokens decoded (without a stop string or special tokens); ``""`` without a tokenizer.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (the logits were NaN, or choosing the
            request's token failed; the step API reports it, ``Engine.generate`` raises ``ValueError``).
        logprobs: one ``TokenLogprob`` per new token when ``logprobs`` was asked, else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: Any
    text: Any
    finish_reason: Any
    logprobs: Any = None


@dataclasses.dataclass
class RequestDelta:
    """What one engine step added to one sample of a request (the async API streams these).

    Attributes:
        request_id: the request's id.
        index: the sample (0 .. n - 1).
        token_ids: the tokens added.
        text: the text they completed (possibly empty).
        finish_reason: why the sample ended in this step (see ``FINISH_REASONS``), or None while it runs.
        logprobs: one ``TokenLogprob`` per added token when the request asked for them, else None.
    """

    request_id: str
    index: int  # the sample (0 .. n - 1)
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


def pack_delta(delta: RequestDelta) -> tuple:
    """A delta as plain tuples for the pipe (half the pickled bytes of the dataclasses).

    Args:
        delta: the delta.

    Returns:
        Its fields, its log-probabilities as ``(token_id, logprob, top)`` tuples.
    """
    logprobs = None if delta.logprobs is None else [(e.token_id, e.logprob, e.top) for e in delta.logprobs]
    return delta.request_id, delta.index, delta.token_ids, delta.text, delta.finish_reason, logprobs


def unpack_delta(item: tuple) -> RequestDelta:
    """The delta ``pack_delta`` packed.

    Args:
        item: what ``pack_delta`` returned.

    Returns:
        The delta.
    """
    request_id, index, token_ids, text, finish_reason, logprobs = item
    return RequestDelta(request_id, index, token_ids, text, finish_reason,
                        None if logprobs is None else [TokenLogprob(*e) for e in logprobs])


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One checked request: its prompt ids and how to continue it.

    Attributes:
        prompt: the prompt's token ids.
        params: the sampling parameters.
        max_tokens: new tokens per sample at most.
        stop_ids: token ids that end a sample (the EOS included).
        stop_strings: strings that end a sample (cut from its text).
        n: the number of samples.
        seed: the sampling seed, or None.
        logprobs: how many top log-probabilities to report per token, or None for none.
        constraint: a ``CompiledConstraint`` the output must follow, or None.
        logit_bias: ``(token id, bias)`` pairs added to the logits.
        adapter: the LoRA adapter the request runs with, or None.
        cache_salt: seeds its prefix-cache keys (cached blocks are shared only under one salt), or None.
    """

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    n: int
    seed: int | None
    logprobs: int | None
    constraint: Any = None  # a CompiledConstraint (models.generation.constraints), or None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits
    adapter: Any = None  # the LoRA adapter (serving.lora_registry.LoRAAdapter) the request runs with, or None
    cache_salt: bytes | None = None  # seeds its prefix-cache keys: cached blocks are shared only under one salt


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request while the engine runs it: its tokens, its blocks and what it has computed.

    Attributes:
        request_id: the request's id.
        index: the sample (0 .. n - 1).
        spec: the checked request.
        generator: the sample's random generator (seeded requests), or None.
        arrival: the order in which it arrived (for scheduling).
        tokens: prompt + output tokens.
        block_table: the KV-cache blocks holding its keys/values, in order.
        block_hashes: the prefix-cache hashes of its committed full blocks.
        num_computed: tokens whose keys/values are in the cache.
        finish_reason: why it ended, or None while it runs.
        text: the output's text so far.
        sent_tokens: output tokens already reported in a delta.
        sent_text: characters of ``text`` already reported.
        logprobs: one ``TokenLogprob`` per output token when asked.
        detokenizer: decodes the output a window at a time, or None.
        seen: ``(1, V)`` bool, the tokens seen (for the repetition penalty), or None.
        counts: ``(1, V)`` int32, each token's count in the output (presence/frequency penalties), or None.
        forked: whether the request's other samples exist.
        guide: the sample's ``ConstraintState`` when its request has a constraint.
        error: why the sample ended with finish_reason ``"error"``.
    """

    request_id: str
    index: int
    spec: RequestSpec
    generator: torch.Generator | None
    arrival: int
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + output
    block_table: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of the committed full blocks
    num_computed: int = 0  # tokens whose keys/values are in the cache
    finish_reason: str | None = None
    text: str = ""
    sent_tokens: int = 0  # output tokens already reported in a delta
    sent_text: int = 0
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    detokenizer: IncrementalText | None = None  # the output's text, decoded a window at a time
    seen: torch.Tensor | None = None  # (1, V) bool, for the repetition penalty
    counts: torch.Tensor | None = None  # (1, V) int32: each token's count in the output (presence/frequency)
    forked: bool = False  # the request's other samples exist
    guide: Any = None  # the sample's ConstraintState when its request has a constraint
    error: str | None = None  # why the sample ended with finish_reason "error"

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.spec.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.spec.prompt):]


class IncrementalText:
    """The text of a growing token sequence, decoded a window at a time (as vLLM's incremental detokenizer and
    ``transformers``' ``TextStreamer``): O(new tokens) per step instead of decoding the whole output every step.

    Text advances only when the window decodes to complete characters: ``decode(tokens[prefix:])`` is compared with
    ``decode(tokens[prefix:read])``, where ``read`` is where the text last advanced (a character boundary) and
    ``prefix`` the boundary before it — decoding from a token already decoded keeps what decoders do to a first token
    (SentencePiece's leading space) out of the difference. A window ending in U+FFFD waits for the rest of its
    character's bytes, and so does one whose decoded start changed. For decoders that never rewrite a completed
character (byte-level BPE, SentencePiece on valid UTF-8), ``text`` is always a prefix of ``decode(tokens)``;
``finish()`` returns all of it.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = self.read = 0
        self.prefix_text = ""  # decode(tokens[prefix:read])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: Seq[int]) -> str:
        """Append tokens; return the text they completed.

        Args:
            token_ids: the new tokens.

        Returns:
            The text they completed (possibly empty, while a character's bytes are incomplete).
        """
        self.tokens += token_ids
        window = self._decode(self.tokens[self.prefix:])
        if len(window) <= len(self.prefix_text) or window.endswith("\ufffd") or not window.startswith(self.prefix_text):
            return ""
        new = window[len(self.prefix_text):]
        self.text += new
        self.prefix, self.read = self.read, len(self.tokens)
        self.prefix_text = self._decode(self.tokens[self.prefix:self.read])
        return new

    def finish(self) -> str:
        """The whole text, ``decode(tokens)``, decoded once: exact even where a decoder rewrites characters it had
        completed (byte fallback turns a finished character into U+FFFD when invalid bytes follow it).

        Returns:
            The decoded text of all the tokens.
        """
        return self._decode(self.tokens)


def per_prompt(value: Any, n_prompts: int, name: str, is_list: Any = None) -> list[Any]:
    """``value`` repeated for every prompt, or ``value`` itself when it is a list with one item per prompt.

    Args:
        value: one value for all prompts, or a list of one per prompt.
        n_prompts: the number of prompts.
        name: the argument's name (for the error message).
        is_list: tells whether ``value`` is per prompt (None: whether it is a list).

    Returns:
        One value per prompt.

    Raises:
        ValueError: a per-prompt list whose length is not the number of prompts.
    """
    listed = isinstance(value, list) if is_list is None else is_list(value)
    if not listed:
        return [value] * n_prompts
    if len(value) != n_prompts:
        raise ValueError(f"{name} has {len(value)} values for {n_prompts} prompts; expected one, or one per prompt")
    return list(value)


def stop_is_per_prompt(value: Any) -> bool:
    """Whether a ``stop`` list gives one stop specification per prompt (every item None or a list/tuple).

    Args:
        value: the ``stop`` argument.

    Returns:
        True when it is a non-empty list of per-prompt stops.
    """
    return isinstance(value, list) and bool(value) and all(v is None or isinstance(v, (list, tuple)) for v in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_prompt(prompt: Any, tokenizer: Any, vocab_size: int, context: int) -> list[int]:
    """A prompt (a string or token ids) as a list of ids in the vocabulary.

    Args:
        prompt: a string, a list of token ids or a 1-D integer tensor.
        tokenizer: encodes a string prompt (None: only ids are accepted).
        vocab_size: the number of token ids.
        context: the engine's context (prompt + output tokens at most).

    Returns:
        The prompt's token ids.

    Raises:
        ValueError: an empty prompt, a string without a tokenizer, ids outside ``[0, vocab_size)`` or a prompt
            with ``context`` tokens or more (no room for one new token).
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {prompt[:40]!r} is a string but the engine has no tokenizer; pass token ids")
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(f"a tensor prompt must be 1-D integer ids, got {tuple(prompt.shape)} {prompt.dtype}")
        ids = prompt.tolist()
    elif isinstance(prompt, Seq) and all(_is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("empty prompt: expected at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, vocab_size={vocab_size})")
    if len(ids) >= context:
        raise ValueError(
            f"prompt of {len(ids)} tokens is longer than the context: expected at most {context - 1} tokens "
            f"(max_model_len={context} leaves room for one new token)"
        )
    return ids


def check_stop(stop: Any, tokenizer: Any, vocab_size: int) -> tuple[frozenset[int], tuple[str, ...]]:
    """Stop token ids and stop strings from ``stop`` (None, a string, an id, or a list/tuple mixing them).

    Args:
        stop: the request's stop argument.
        tokenizer: needed for stop strings (None: ids only).
        vocab_size: the number of token ids.

    Returns:
        ``(stop ids, stop strings)``.

    Raises:
        ValueError: an empty stop string, a stop string without a tokenizer, or an item that is neither a string
            nor a token id in the vocabulary.
    """
    items = [] if stop is None else list(stop) if isinstance(stop, (list, tuple)) else [stop]
    ids, strings = set(), []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ValueError("stop strings must be non-empty")
            if tokenizer is None:
                raise ValueError(f"stop string {item!r} needs a tokenizer; the engine has none (use stop token ids)")
            strings.append(item)
        elif _is_int(item) and 0 <= item < vocab_size:
            ids.add(int(item))
        else:
            raise ValueError(f"stop item {item!r} must be a non-empty string or a token id in [0, {vocab_size})")
    return frozenset(ids), tuple(strings)


def check_request(
    prompt: Any, sampling: Any, max_tokens: Any, stop: Any, n: Any, seed: Any, logprobs: Any, *,
    tokenizer: Any, vocab_size: int, context: int, eos: int | None, cache_tokens: int,
) -> RequestSpec:
    """Check one request's arguments (see ``Engine.generate``) and return its ``RequestSpec``.

    Args:
        prompt: a string or token ids.
        sampling: the sampling parameters (None: greedy).
        max_tokens: new tokens per sample at most.
        stop: stop strings and/or token ids.
        n: the number of samples.
        seed: the sampling seed, or None.
        logprobs: how many top log-probabilities to report per token, or None.
        tokenizer: the engine's tokenizer, or None.
        vocab_size: the number of token ids.
        context: the engine's context.
        eos: the EOS token id, added to the stop ids (None: none).
        cache_tokens: the positions the paged cache holds in all.

    Returns:
        The checked request.

    Raises:
        ValueError: naming the bad argument and what was expected.
    """
    ids = check_prompt(prompt, tokenizer, vocab_size, context)
    if sampling is None:
        sampling = SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not _is_int(n) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if n > 1 and not sampling.do_sample:
        raise ValueError(f"n={n} samples need sampling (SamplingParams(do_sample=True)); greedy samples are equal")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [-2**63, 2**63) (int64, as OpenAI's) or None, got {seed!r}")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= vocab_size):
        raise ValueError(f"logprobs must be None or an integer in [0, {vocab_size}], got {logprobs!r}")
    stop_ids, stop_strings = check_stop(stop, tokenizer, vocab_size)
    if eos is not None:
        stop_ids = stop_ids | {eos}
    # The longest a sample can get: its prompt and max_tokens, within the context (the last token is never fed
    # back, so it needs no slot).
    needed = min(len(ids) + max_tokens, context) - 1
    if needed > cache_tokens:
        raise ValueError(
            f"the paged cache is too small for this request: it needs {needed} positions (prompt {len(ids)} + "
            f"max_tokens {max_tokens}), the cache holds {cache_tokens}; raise num_blocks or lower max_tokens"
        )
    return RequestSpec(ids, sampling, int(max_tokens), stop_ids, stop_strings, int(n),
                       None if seed is None else int(seed), None if logprobs is None else int(logprobs))
