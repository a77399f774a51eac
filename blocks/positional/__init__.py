"""Positional encodings, registered under kind ``positional``."""

from .alibi import ALiBiPositionalBias, alibi_slopes
from .base import PositionalEncoding
from .learned import LearnedPositionalEmbedding
from .none import NoPositionalEncoding
from .rotary import RotaryPositionalEncoding, rotate_half
from .sinusoidal import ConcatSinusoidalPositionalEncoding, SinusoidalPositionalEncoding, sinusoid_table

__all__ = [
    "ALiBiPositionalBias",
    "ConcatSinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "NoPositionalEncoding",
    "PositionalEncoding",
    "RotaryPositionalEncoding",
    "SinusoidalPositionalEncoding",
    "alibi_slopes",
    "rotate_half",
    "sinusoid_table",
]
