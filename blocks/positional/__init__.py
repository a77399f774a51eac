"""Positional encodings, registered under kind ``positional``."""

from .alibi import ALiBiPositionalBias, alibi_slopes
from .base import PositionalEncoding
from .learned import LearnedPositionalEmbedding
from .none import NoPositionalEncoding
from .relative import T5RelativePositionBias, relative_position_buckets
from .rotary import InterleavedRotaryPositionalEncoding, RotaryPositionalEncoding, rotary_frequencies, rotate_half
from .sinusoidal import ConcatSinusoidalPositionalEncoding, SinusoidalPositionalEncoding, sinusoid_table

__all__ = [
    "ALiBiPositionalBias",
    "ConcatSinusoidalPositionalEncoding",
    "InterleavedRotaryPositionalEncoding",
    "LearnedPositionalEmbedding",
    "NoPositionalEncoding",
    "PositionalEncoding",
    "RotaryPositionalEncoding",
    "SinusoidalPositionalEncoding",
    "T5RelativePositionBias",
    "alibi_slopes",
    "relative_position_buckets",
    "rotary_frequencies",
    "rotate_half",
    "sinusoid_table",
]
