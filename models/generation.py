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

from .base import new_caches
from .sampling import SamplingParams

__all__ = [
    "CACHE_CHUNK",
    "CONFIG_DEFAULT",
    "DecoderLMGenerationMixin",
    "EncoderLMFillMaskMixin",
    "FillMaskOutput",
    "Seq2SeqGenerationMixin",
    "SamplingParams",
    "new_caches",
]


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


class QuantizeMixin:
    """``quantize`` and ``dequantize`` for every family: weight-only int8 decoding (see ``blocks.quantized``).

    A quantized model saves, loads and pushes like any other: ``config.json`` records the scheme and the quantized
    layers (see ``models.persistence``), and ``from_pretrained`` quantizes the freshly built model before loading.
    """

    def quantize(self, scheme: str = "int8") -> nn.Module:
        """Store every linear layer's weight as int8 with a float32 scale per output channel, in place.

        Meant for inference (decoding reads each weight once per token, so a quarter of the bytes is read);
        the quantized layers hold buffers, not trainable parameters. A head tied to the embedding gets its own
        int8 copy; the embedding stays float.

        Args:
            scheme: a name of ``blocks.names("quantization")`` (``"int8"``).

        Returns:
            The model itself.

        Raises:
            ValueError: unknown ``scheme``.
        """
        from blocks.quantized import quantize_linears

        return quantize_linears(self, scheme)

    def dequantize(self) -> nn.Module:
        """Replace every quantized layer by a float ``nn.Linear`` holding ``scale · q``, in place.

        The model then computes what the quantized one did, up to float rounding, and can be trained, exported
        to ``transformers`` or quantized again. The float weights are the rounded ones: the original weights are
        not recovered. A head that was tied to the embedding keeps its own (dequantized) weights, so
        ``config.tie_embeddings`` becomes ``False`` and the model saves and loads as an untied one.

        Returns:
            The model itself.

        Raises:
            ValueError: the model has no quantized layers.
        """
        from blocks.quantized import dequantize_linears, quantized_modules

        quantized = quantized_modules(self)
        if not quantized:
            raise ValueError(
                f"this {type(self).__name__} has no quantized layers to dequantize; expected a model quantized with "
                "model.quantize(...) or loaded from a quantized checkpoint"
            )
        # The model's float dtype, taken from its float parameters (embeddings, norms), so the new layers match it.
        dtypes = [p.dtype for p in self.parameters() if p.is_floating_point()]
        dtype = max(set(dtypes), key=dtypes.count) if dtypes else None
        untied = self._tied_in_config(list(quantized))
        dequantize_linears(self, dtype)
        if untied and getattr(self.config, "tie_embeddings", False):
            self.config = self.config.replace(tie_embeddings=False)
        return self

    def _tied_in_config(self, layer_names: list[str]) -> bool:
        """Whether a model built from the config ties the weight of one of ``layer_names`` to another parameter."""
        with torch.device("meta"):  # no memory, no initialisation work: only the tying structure is wanted
            fresh = type(self)(self.config)
        owners: dict[int, int] = {}
        for _, p in fresh.named_parameters(remove_duplicate=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
        params = dict(fresh.named_parameters(remove_duplicate=False))
        return any(owners[id(params[f"{name}.weight"])] > 1 for name in layer_names if f"{name}.weight" in params)


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


# The family modules import the helpers above, so they are imported last (they also look ``new_caches`` and
# ``CACHE_CHUNK`` up on this module at call time, so that both can be replaced here, e.g. in tests).
from .generation_decoder import DecoderLMGenerationMixin  # noqa: E402
from .generation_fill_mask import EncoderLMFillMaskMixin, FillMaskOutput  # noqa: E402
from .generation_seq2seq import Seq2SeqGenerationMixin  # noqa: E402
