"""Tokenization for the zoo's models: a thin layer on the Hugging Face ``tokenizers`` library.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (``.backend``): special-token roles and ids, batch encoding to
``(B, L)`` tensors with bool masks, decoding, and standard ``tokenizer.json`` files. ``train_bpe``,
``train_wordpiece`` and ``train_byte_level_bpe`` learn a vocabulary from files or an iterator of strings.
"""

from .normalization import build_normalizer
from .special_tokens import DEFAULT_SPECIAL_TOKENS, ROLES
from .templates import FAMILIES, template_processor
from .tokenizer import Tokenizer
from .trainers import train_bpe, train_byte_level_bpe, train_wordpiece

__all__ = [
    "DEFAULT_SPECIAL_TOKENS",
    "FAMILIES",
    "ROLES",
    "Tokenizer",
    "build_normalizer",
    "template_processor",
    "train_bpe",
    "train_byte_level_bpe",
    "train_wordpiece",
]
