"""Generation: decoding loops for the three model families (mixed into the model classes)."""

from __future__ import annotations


class DecoderLMGenerationMixin:
    """``generate`` and ``stream`` for ``DecoderLM``."""


class Seq2SeqGenerationMixin:
    """``generate`` (beam search / greedy) for ``Seq2SeqTransformer``."""


class EncoderLMFillMaskMixin:
    """``fill_mask`` for ``EncoderLM``."""
