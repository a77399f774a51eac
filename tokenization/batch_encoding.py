"""The options of a batch encoding (``Tokenizer.__call__``): checked before anything is encoded, and set on the Rust
tokenizer for one call only.

A loaded Hugging Face ``tokenizer.json`` may carry its own padding and truncation settings; ``backend_settings``
puts them back after the call, so they survive a save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import tokenizers

#: the values of ``padding``: True and "longest" pad to the longest row, "max_length" to ``max_length``.
PADDING_CHOICES = (True, False, "longest", "max_length")


def as_text_batch(texts: str | Sequence[str], name: str) -> list[str]:
    """One text or a sequence of texts as a list of texts.

    Args:
        texts: a string, or a sequence of strings.
        name: the argument's name (for the message: ``"texts"``, ``"text_pairs"``).

    Returns:
        The texts, a one-element list for a single string.

    Raises:
        ValueError: an element that is not a string (its type and value are named).
    """
    if isinstance(texts, str):
        return [texts]
    texts = list(texts)
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"{name} must be a string or a list of strings, found {type(bad).__name__} {bad!r}")
    return texts


def check_batch_options(
    *, padding: bool | str, truncation: bool, max_length: int | None, return_tensors: str | None, padding_side: str,
    pad_token_id: int | None,
) -> None:
    """Check the options of a batch encoding together, before anything is encoded.

    Args:
        padding: one of ``PADDING_CHOICES``.
        truncation: whether rows are cut to ``max_length``.
        max_length: the length for truncation and "max_length" padding, or None.
        return_tensors: "pt" or None.
        padding_side: "right" or "left".
        pad_token_id: the tokenizer's pad id (None: it has no pad token).

    Raises:
        ValueError: a value outside its choices (named), truncation or "max_length" padding without
            ``max_length``, or padding without a pad token.
    """
    if padding not in PADDING_CHOICES:
        raise ValueError(f"padding must be one of {list(PADDING_CHOICES)}, got {padding!r}")
    if return_tensors not in ("pt", None):
        raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
    if (truncation or padding == "max_length") and max_length is None:
        raise ValueError("truncation=True and padding='max_length' need max_length")
    if padding and pad_token_id is None:
        raise ValueError("this tokenizer has no pad token; pass padding=False or give special_tokens={'pad': ...}")


@contextlib.contextmanager
def backend_settings(
    backend: tokenizers.Tokenizer, *, padding: bool | str, truncation: bool, max_length: int | None, side: str,
    pad_id: int | None, pad_token: str | None,
) -> Iterator[None]:
    """Set the backend's padding and truncation for one call, then restore what it had.

    Args:
        backend: the Rust tokenizer.
        padding: one of ``PADDING_CHOICES`` (checked by ``check_batch_options``).
        truncation: cut rows to ``max_length``.
        max_length: the length for truncation and "max_length" padding.
        side: "right" or "left": where padding goes.
        pad_id: the pad token's id.
        pad_token: the pad token's text.

    Yields:
        Nothing: the settings hold while the block runs.
    """
    old_padding, old_truncation = backend.padding, backend.truncation
    try:
        if padding:
            backend.enable_padding(direction=side, pad_id=pad_id, pad_token=pad_token,
                                   length=max_length if padding == "max_length" else None)
        else:
            backend.no_padding()
        if truncation:
            backend.enable_truncation(max_length)
        else:
            backend.no_truncation()
        yield
    finally:
        if old_padding is None:
            backend.no_padding()
        else:
            backend.enable_padding(**old_padding)
        if old_truncation is None:
            backend.no_truncation()
        else:
            backend.enable_truncation(**old_truncation)
