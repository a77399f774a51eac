"""Generation: the decoding loops mixed into the model classes, and what they share.

- ``steps`` — what every loop shares: the step type, the token loop, cache growth and eval-mode handling.
- ``requests`` — the checked request types (``LMRequest``, ``Seq2SeqRequest``) and the argument checks.
- ``sampling`` — ``SamplingParams`` and the logits processors (temperature, top-k, top-p, repetition penalty).
- ``beam_search`` — beam search with the GNMT length penalty (paper §6.1), over any step function.
- ``decoder`` — ``DecoderLM.generate`` / ``stream`` (``DecoderLMGenerationMixin``).
- ``seq2seq`` — ``Seq2SeqTransformer.generate`` / ``stream`` (``Seq2SeqGenerationMixin``).
- ``fill_mask`` — ``EncoderLM.fill_mask`` / ``fill_mask_text`` (``EncoderLMFillMaskMixin``).
- ``compiled`` and ``seq2seq_compiled`` — static-shape compiled one-token steps (``generate(..., compile=True)``).
- ``speculative`` — speculative decoding with a draft model (Leviathan et al. 2023).
"""

from .decoder import DecoderLMGenerationMixin
from .fill_mask import EncoderLMFillMaskMixin, FillMaskOutput
from .sampling import SamplingParams
from .seq2seq import Seq2SeqGenerationMixin
from .speculative import SpeculativeOutput, speculative_decode

__all__ = [
    "DecoderLMGenerationMixin",
    "EncoderLMFillMaskMixin",
    "FillMaskOutput",
    "SamplingParams",
    "Seq2SeqGenerationMixin",
    "SpeculativeOutput",
    "speculative_decode",
]
