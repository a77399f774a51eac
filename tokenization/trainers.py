"""Train BPE, WordPiece and byte-level BPE tokenizers from text files or an iterator of strings.

Each trainer builds a ``tokenizers`` pipeline (normaliser, pre-tokenizer, model, decoder), trains it with the
library's Rust trainer, registers the special tokens first (``[PAD]``=0, ``[UNK]``=1, ``[BOS]``=2,
``[EOS]``=3, ``[MASK]``=4 by default) and installs a post-processing template for a model family.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from .normalization import build_normalizer
from .special_tokens import DEFAULT_SPECIAL_TOKENS, ROLES, check_special_tokens
from .templates import template_processor
from .tokenizer import Tokenizer

PathLike = str | os.PathLike[str]


def train_bpe(
    texts: Iterable[str] | None = None,
    *,
    files: Sequence[PathLike] | None = None,
    vocab_size: int = 8000,
    min_frequency: int = 2,
    special_tokens: Mapping[str, str | None] | None = None,
    extra_special_tokens: Sequence[str] = (),
    unicode_form: str | None = "nfkc",
    lowercase: bool = False,
    strip_accents: bool = False,
    template: str = "decoder",
    show_progress: bool = False,
) -> Tokenizer:
    """Train a SentencePiece-style BPE tokenizer (spaces become ``▁`` and are restored on decoding).

    Args:
        texts: an iterable of strings to learn from, or
        files: text files to learn from (exactly one of the two).
        vocab_size: the final vocabulary size, special tokens included.
        min_frequency: pairs seen fewer times are not merged.
        special_tokens: role -> token, overriding ``DEFAULT_SPECIAL_TOKENS`` (None drops a role).
        extra_special_tokens: more special tokens, after the roles' tokens.
        unicode_form: Unicode normal form ("NFC", "NFKC" ...) or None (see ``build_normalizer``).
        lowercase: lowercase the text (see ``build_normalizer``).
        strip_accents: strip accents (see ``build_normalizer``).
        template: post-processing family: "encoder", "decoder", "seq2seq" or "none".
        show_progress: the Rust trainer's progress bar.

    Returns:
        The trained ``Tokenizer``.

    Raises:
        ValueError: bad sizes, roles, normalisation or template, both or neither of texts/files, or a str
            passed as ``texts``.
        FileNotFoundError: a missing file.
    """
    specials = _special_list(special_tokens, extra_special_tokens, vocab_size, reserved=0)
    roles = _roles(special_tokens)
    backend = Backend(models.BPE(unk_token=roles["unk"]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=_check_min_frequency(min_frequency), special_tokens=specials,
        show_progress=show_progress,
    )
    return _train(backend, trainer, texts, files, roles, unicode_form, lowercase, strip_accents, template)


def train_wordpiece(
    texts: Iterable[str] | None = None,
    *,
    files: Sequence[PathLike] | None = None,
    vocab_size: int = 8000,
    min_frequency: int = 2,
    special_tokens: Mapping[str, str | None] | None = None,
    extra_special_tokens: Sequence[str] = (),
    unicode_form: str | None = "nfd",
    lowercase: bool = True,
    strip_accents: bool = True,
    template: str = "encoder",
    continuing_subword_prefix: str = "##",
    show_progress: bool = False,
) -> Tokenizer:
    """Train a BERT-style WordPiece tokenizer (uncased, accents stripped by default).

    The ``unk`` role must have a token: WordPiece maps unknown words to it. The arguments not listed are as for
    ``train_bpe``.

    Args:
        texts: an iterable of strings to learn from (or ``files``).
        continuing_subword_prefix: marks pieces inside a word (``##``).

    Returns:
        The trained ``Tokenizer``.

    Raises:
        ValueError: no ``unk`` token, an empty ``continuing_subword_prefix``, or as ``train_bpe``.
    """
    specials = _special_list(special_tokens, extra_special_tokens, vocab_size, reserved=0)
    roles = _roles(special_tokens)
    if roles["unk"] is None:
        raise ValueError("WordPiece needs an unk token; special_tokens['unk'] must not be None")
    if not isinstance(continuing_subword_prefix, str) or not continuing_subword_prefix:
        raise ValueError(f"continuing_subword_prefix must be a non-empty string, got {continuing_subword_prefix!r}")
    backend = Backend(models.WordPiece(unk_token=roles["unk"], continuing_subword_prefix=continuing_subword_prefix))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix=continuing_subword_prefix)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=_check_min_frequency(min_frequency), special_tokens=specials,
        continuing_subword_prefix=continuing_subword_prefix, show_progress=show_progress,
    )
    return _train(backend, trainer, texts, files, roles, unicode_form, lowercase, strip_accents, template)


def train_byte_level_bpe(
    texts: Iterable[str] | None = None,
    *,
    files: Sequence[PathLike] | None = None,
    vocab_size: int = 8000,
    min_frequency: int = 2,
    special_tokens: Mapping[str, str | None] | None = None,
    extra_special_tokens: Sequence[str] = (),
    unicode_form: str | None = None,
    lowercase: bool = False,
    strip_accents: bool = False,
    template: str = "decoder",
    add_prefix_space: bool = False,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a GPT-2-style byte-level BPE tokenizer: every string encodes (no unknown tokens) and, with no
    normalisation (the default), decodes back exactly.

    The arguments not listed, and the errors, are as for ``train_bpe``.

    Args:
        texts: an iterable of strings to learn from (or ``files``).
        vocab_size: the final vocabulary size; must leave room for the 256 byte symbols.
        add_prefix_space: treat the first word like any other (GPT-2 does not).

    Returns:
        The trained ``Tokenizer``.
    """
    specials = _special_list(special_tokens, extra_special_tokens, vocab_size, reserved=256)
    roles = _roles(special_tokens)
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=_check_min_frequency(min_frequency), special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress,
    )
    return _train(backend, trainer, texts, files, roles, unicode_form, lowercase, strip_accents, template)


# ---------------------------------------------------------------------------------------------------------
def _roles(special_tokens: Mapping[str, str | None] | None) -> dict[str, str | None]:
    return check_special_tokens({**DEFAULT_SPECIAL_TOKENS, **check_special_tokens(special_tokens or {})})


def _special_list(
    special_tokens: Mapping[str, str | None] | None, extra: Sequence[str], vocab_size: int, reserved: int
) -> list[str]:
    """The special tokens in id order (roles first, in ``ROLES`` order), after checking the sizes."""
    roles = _roles(special_tokens)
    if isinstance(extra, str) or not all(isinstance(t, str) and t for t in extra):
        raise ValueError(f"extra_special_tokens must be a list of non-empty strings, got {extra!r}")
    tokens = [roles[r] for r in ROLES if roles[r] is not None] + list(extra)
    duplicates = sorted({t for t in tokens if tokens.count(t) > 1})
    if duplicates:
        raise ValueError(f"special tokens {duplicates} are listed twice; each needs its own id when training")
    needed = len(tokens) + reserved + 1
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < needed:
        raise ValueError(
            f"vocab_size must be an integer >= {needed} ({len(tokens)} special tokens"
            f"{f' + {reserved} byte symbols' if reserved else ''} + 1), got {vocab_size!r}"
        )
    return tokens  # type: ignore[return-value]


def _check_min_frequency(min_frequency: int) -> int:
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 0:
        raise ValueError(f"min_frequency must be an integer >= 0, got {min_frequency!r}")
    return min_frequency


def _checked_texts(texts: Iterable[str]) -> Iterator[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts must yield strings; item {i} is {type(text).__name__} {text!r}")
        yield text


def _train(
    backend: Backend,
    trainer: trainers.Trainer,
    texts: Iterable[str] | None,
    files: Sequence[PathLike] | None,
    roles: dict[str, str | None],
    unicode_form: str | None,
    lowercase: bool,
    strip_accents: bool,
    template: str,
) -> Tokenizer:
    if (texts is None) == (files is None):
        raise ValueError("pass exactly one of texts (an iterable of strings) or files (a list of paths)")
    if isinstance(texts, str):
        raise ValueError("texts must be an iterable of strings, got a single str; wrap it in a list")
    if files is not None:
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        missing = [str(f) for f in files if not Path(f).is_file()]
        if missing:
            raise FileNotFoundError(f"training file(s) not found: {missing}")
    # Validate the template against the roles before the (slow) training, with placeholder ids.
    template_processor(template, {role: None if tok is None else (tok, 0) for role, tok in roles.items()})
    backend.normalizer = build_normalizer(unicode_form, lowercase=lowercase, strip_accents=strip_accents)
    if files is not None:
        backend.train([str(f) for f in files], trainer)
    else:
        backend.train_from_iterator(_checked_texts(texts), trainer)  # type: ignore[arg-type]
    tokenizer = Tokenizer(backend, roles)
    tokenizer.set_template(template)
    return tokenizer
