"""Generation requests: every argument of a decoding call checked before any computation, defaults resolved.

``lm_request`` builds the ``LMRequest`` of ``DecoderLM.generate`` / ``stream`` and of speculative decoding;
``seq2seq_request`` the ``Seq2SeqRequest`` of ``Seq2SeqTransformer.generate`` / ``stream``. The checks they share
(token ids, counts, flags, the generator, the sampling settings, what ``compile=True`` supports) are public here
for the loops that take more arguments.

How the next token is chosen is one frozen object, ``models.generation.sampling.SamplingParams``:
``generate(..., sampling=SamplingParams(do_sample=True, top_p=0.9))``; the separate keyword arguments
(``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``) remain as a thin layer that builds
it (``sampling_params``).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch
from torch import Tensor

from .sampling import SamplingParams


class _ConfigDefault:
    """Marks a token-id argument left to the model's config (``None`` means "no such token")."""

    def __repr__(self) -> str:
        return "<config default>"


#: Default of the token-id arguments: take the value from ``model.config``.
CONFIG_DEFAULT: Any = _ConfigDefault()


@dataclasses.dataclass(kw_only=True)
class DecodingRequest:
    """What every decoding loop reads from a checked request: how many tokens, how to choose them, when to stop.

    Attributes:
        max_new_tokens: the most tokens to generate per row.
        params: how each token is chosen.
        eos: the stop token, or None to never stop early.
        pad: the token written in a row after it stopped.
        generator: the random generator of sampling, or None for torch's global one.
        compile: decode with the compiled static-shape step.
    """

    max_new_tokens: int
    params: SamplingParams
    eos: int | None
    pad: int
    generator: torch.Generator | None
    compile: bool = False  # decode with the compiled static-shape step


@dataclasses.dataclass(kw_only=True)
class LMRequest(DecodingRequest):
    """A validated ``DecoderLM.generate`` / ``stream`` request.

    Attributes:
        prompt: the prompt token ids ``(B, L)``, L >= 1.
        mask: the prompt's bool padding mask ``(B, L)`` (left padding), None when nothing is padded.
    """

    prompt: Tensor  # (B, L), L >= 1
    mask: Tensor | None  # (B, L) bool, None when nothing is padded


@dataclasses.dataclass(kw_only=True)
class Seq2SeqRequest(DecodingRequest):
    """A validated ``Seq2SeqTransformer.generate`` / ``stream`` request (what beam search and greedy share).

    Attributes:
        src_ids: the source token ids ``(B, S)``, S >= 1.
        src_mask: the source's bool padding mask ``(B, S)``, None when nothing is padded.
        start: the decoder start token.
    """

    src_ids: Tensor  # (B, S), S >= 1
    src_mask: Tensor | None  # (B, S) bool, None when nothing is padded
    start: int  # the decoder start token


def resolve_token(value: Any, default: int | None, name: str, vocab_size: int) -> int | None:
    """``value`` (or ``default`` for ``CONFIG_DEFAULT``) checked to be None or an id in the vocabulary.

    Args:
        value: the token id given, None, or ``CONFIG_DEFAULT``.
        default: the config's id, used for ``CONFIG_DEFAULT``.
        name: the argument's name, for the error message.
        vocab_size: the size of the vocabulary.

    Returns:
        The id as an ``int``, or None.

    Raises:
        ValueError: ``value`` is neither None nor an integer in ``[0, vocab_size)``.
    """
    if value is CONFIG_DEFAULT:
        value = default
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < vocab_size:
        raise ValueError(f"{name}={value!r} must be None or an id in [0, vocab_size={vocab_size})")
    return int(value)


def resolve_eos_pad(eos_token_id: Any, pad_token_id: Any, config: Any) -> tuple[int | None, int]:
    """The stop id (None: never stop) and the id written after it (the pad id, else the EOS id).

    Args:
        eos_token_id: the EOS id given (``CONFIG_DEFAULT``: the config's).
        pad_token_id: the pad id given (``CONFIG_DEFAULT``: the config's).
        config: the model's config (its ``eos_token_id``, ``pad_token_id`` and ``vocab_size``).

    Returns:
        ``(eos, pad)``: pad falls back to the EOS id, else 0.

    Raises:
        ValueError: from ``resolve_token``, an id outside the vocabulary.
    """
    eos = resolve_token(eos_token_id, config.eos_token_id, "eos_token_id", config.vocab_size)
    pad = resolve_token(pad_token_id, config.pad_token_id, "pad_token_id", config.vocab_size)
    if pad is None:
        pad = eos if eos is not None else 0  # without an EOS no row ends early, so nothing is padded
    return eos, pad


def check_count(value: Any, name: str) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= 0 (a bool is not a count).

    Args:
        value: the value to check.
        name: the argument's name, for the error message.

    Raises:
        ValueError: ``value`` is a bool, not an integer, or negative.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def check_flag(value: Any, name: str) -> None:
    """Raise ``ValueError`` unless ``value`` is ``True`` or ``False`` (not merely truthy).

    Args:
        value: the value to check.
        name: the argument's name, for the error message.

    Raises:
        ValueError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_generator(generator: Any, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``generator`` is None or a ``torch.Generator`` on ``device``'s kind.

    Args:
        generator: the generator given.
        device: the device of the inputs.

    Raises:
        ValueError: ``generator`` is not a ``torch.Generator``, or is on another kind of device.
    """
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device}, but the inputs are on {device}")


def check_compilable(model: Any) -> None:
    """Reject what the compiled decoding steps (``models.generation.compiled``, ``seq2seq_compiled``) do not
    support, before any work.

    Args:
        model: the model to decode (its ``config.attention_backend`` is read).

    Raises:
        ValueError: naming the unsupported setting — a model whose attention backend is not ``"sdpa"`` or
            ``"math"`` (the others are not traced there).
    """
    backend = getattr(model.config, "attention_backend", "sdpa")
    if backend not in ("sdpa", "math", None):
        raise ValueError(
            f"compile=True supports the 'sdpa' and 'math' attention backends, the model uses {backend!r}; "
            "use compile=False"
        )


def sampling_params(
    sampling: SamplingParams | None,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float | None,
) -> SamplingParams:
    """The one ``SamplingParams`` of a request: ``sampling`` itself, or one built from the keyword arguments.

    Args:
        sampling: the settings given as one object, or None.
        do_sample: sample the next token (False: greedy).
        temperature: the softmax temperature of sampling.
        top_k: keep only the ``top_k`` most likely tokens when sampling, or None.
        top_p: the nucleus threshold of sampling, or None.
        repetition_penalty: the penalty on tokens already seen, or None.

    Returns:
        ``sampling`` when given, else the settings built from the keyword arguments.

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


def check_token_head(model: Any, what: str) -> None:
    """``what`` (generation, fill-mask) predicts tokens: it needs the LM or MLM head.

    Args:
        model: the model (its ``config.head`` is read).
        what: the name of the task, for the error message.

    Raises:
        ValueError: a model whose head is a task head (``config.head``), named.
    """
    head = getattr(model.config, "head", "lm")
    if head not in ("lm", "mlm"):
        raise ValueError(f"{what} predicts tokens, but this model has the {head!r} head instead of its language-model "
                         "head; load the checkpoint with head='lm' (or 'mlm') to predict tokens")


def lm_request(
    model: Any,
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
    sampling: SamplingParams | None = None,
    compile: bool = False,  # noqa: A002 - the name torch uses for this switch
) -> LMRequest:
    """Check every argument of ``DecoderLM.generate`` / ``stream`` on ``model`` before any computation, and
    resolve the defaults.

    Args:
        model: the decoder language model.
        input_ids: the prompt token ids (L may be 0: the BOS token is used).
        attention_mask: the prompt's padding mask (left padding), or None.
        max_new_tokens: the most tokens to generate per row.
        do_sample: sample the next token (False: greedy).
        temperature: the softmax temperature of sampling.
        top_k: keep only the ``top_k`` most likely tokens when sampling, or None.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` when sampling, or None.
        repetition_penalty: the penalty on tokens already seen, or None.
        eos_token_id: the stop token (``CONFIG_DEFAULT``: the config's; None: never stop).
        pad_token_id: the token written after a row stops (``CONFIG_DEFAULT``: the config's).
        generator: the random generator of sampling, or None.
        sampling: the sampling settings as one object, or None (then the keyword arguments build it).
        compile: decode with the compiled static-shape step.

    Returns:
        The checked request (a mask with nothing padded becomes None).

    Raises:
        ValueError: as ``DecoderLM.generate``: an empty prompt without a BOS id, rows ending in padding, more
            positions than the model has, or a bad argument.

    Shapes: input_ids ``(B, L)``, attention_mask ``(B, L)``.
    """
    config = model.config
    check_token_head(model, "generate")
    model.check_ids(input_ids, "input_ids")
    b, length = input_ids.shape
    mask = model.check_mask(attention_mask, (b, length), "attention_mask")
    check_count(max_new_tokens, "max_new_tokens")
    params = sampling_params(sampling, do_sample, temperature, top_k, top_p, repetition_penalty)
    eos, pad = resolve_eos_pad(eos_token_id, pad_token_id, config)
    check_generator(generator, input_ids.device)
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
    capacity = model.positional.max_positions
    if capacity is not None and longest + max_new_tokens > capacity:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} = {longest + max_new_tokens} "
            f"positions, but the model's {config.positional} positions go up to max_len={capacity}"
        )
    check_flag(compile, "compile")
    if compile:
        check_compilable(model)
    return LMRequest(
        prompt=input_ids, mask=mask, max_new_tokens=max_new_tokens, params=params, eos=eos, pad=pad,
        generator=generator, compile=compile,
    )


def seq2seq_request(
    model: Any,
    src_ids: Tensor,
    src_mask: Tensor | None,
    max_new_tokens: int | None,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    repetition_penalty: float | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
    decoder_start_token_id: int | None,
    generator: torch.Generator | None,
    sampling: SamplingParams | None,
    compile: bool,  # noqa: A002 - the name torch uses for this switch
    num_beams: int = 1,
) -> Seq2SeqRequest:
    """Check every argument that ``Seq2SeqTransformer.generate`` and ``stream`` share before any computation, and
    resolve the defaults (``num_beams``, already checked, only rejects sampling settings that need one beam).

    Args:
        model: the encoder-decoder model.
        src_ids: the source token ids.
        src_mask: the source's padding mask, or None.
        max_new_tokens: the most tokens to generate per row, or None for the longest source + 50.
        do_sample: sample the next token (False: greedy).
        temperature: the softmax temperature of sampling.
        top_k: keep only the ``top_k`` most likely tokens when sampling, or None.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` when sampling, or None.
        repetition_penalty: the penalty on tokens already seen, or None.
        eos_token_id: the stop token (``CONFIG_DEFAULT``: the config's; None: never stop).
        pad_token_id: the token written after a row stops (``CONFIG_DEFAULT``: the config's).
        decoder_start_token_id: the decoder start token (``CONFIG_DEFAULT``: the config's).
        generator: the random generator of sampling, or None.
        sampling: the sampling settings as one object, or None.
        compile: decode with the compiled static-shape step.
        num_beams: the beam count of the call (sampling and penalties need 1).

    Returns:
        The checked request (a mask with nothing padded becomes None).

    Raises:
        ValueError: as ``Seq2SeqTransformer.generate``: an empty source, no start token, sampling with beams,
            more target positions than the decoder has, or a bad argument.

    Shapes: src_ids ``(B, S)``, src_mask ``(B, S)``.
    """
    config = model.config
    model.check_ids(src_ids, "src_ids")
    b, src_len = src_ids.shape
    if src_len == 0:
        raise ValueError("src_ids is empty (S=0); give at least one source token")
    src_mask = model.check_mask(src_mask, (b, src_len), "src_mask")
    params = sampling_params(sampling, do_sample, temperature, top_k, top_p, repetition_penalty)
    if num_beams > 1 and (params.do_sample or params.uses_history or params.uses_counts):
        raise ValueError(
            f"do_sample and the repetition, presence and frequency penalties work with num_beams=1 only, got "
            f"num_beams={num_beams} with do_sample={params.do_sample}, repetition_penalty="
            f"{params.repetition_penalty}, presence_penalty={params.presence_penalty}, frequency_penalty="
            f"{params.frequency_penalty}"
        )
    eos, pad = resolve_eos_pad(eos_token_id, pad_token_id, config)
    start = resolve_token(decoder_start_token_id, config.decoder_start_token_id, "decoder_start_token_id",
                          config.vocab_size)
    if start is None:
        raise ValueError("decoder_start_token_id is None (and so is config.decoder_start_token_id)")
    check_generator(generator, src_ids.device)
    check_flag(compile, "compile")
    if compile:
        check_compilable(model)
    capacity = model.decoder_positional.max_positions
    if max_new_tokens is None:
        longest = src_len if src_mask is None else int(src_mask.sum(dim=-1).max())
        max_new_tokens = longest + 50  # §6.1
        if capacity is not None:
            max_new_tokens = min(max_new_tokens, capacity - 1)
    else:
        check_count(max_new_tokens, "max_new_tokens")
        if capacity is not None and 1 + max_new_tokens > capacity:
            raise ValueError(
                f"1 start token + max_new_tokens={max_new_tokens} = {1 + max_new_tokens} target positions, "
                f"but the decoder's {config.positional} positions go up to max_len={capacity}"
            )
    if src_mask is not None and bool(src_mask.all()):
        src_mask = None  # nothing padded: the unmasked path is cheaper at every step
    return Seq2SeqRequest(
        src_ids=src_ids, src_mask=src_mask, max_new_tokens=int(max_new_tokens), params=params, eos=eos, pad=pad,
        start=start, generator=generator, compile=compile,
    )
