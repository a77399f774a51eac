"""T5's vocabulary in a GGUF file (``tokenizer.ggml.model = "t5"``, llama.cpp's UGM): a SentencePiece Unigram model.

The pieces and their scores make a ``tokenizers`` ``Unigram`` model; the file's precompiled charsmap (SentencePiece's
normalization table) is walked and checked before ``tokenizers`` is given it. ``tokenization.gguf`` builds the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

SPACE = "\u2581"  # SentencePiece's visible space


def unigram_backend(tokens: Sequence[str], scores: Sequence[float], metadata: Mapping[str, Any]) -> Backend:
    """T5's vocabulary: a Unigram model over ``▁``-joined words, with the file's normalizer settings.

    Args:
        tokens: the pieces, by id.
        scores: their log probabilities, one per piece.
        metadata: the file's ``tokenizer.*`` metadata (unknown id, precompiled charsmap, whitespace and prefix
            settings).

    Returns:
        The ``tokenizers.Tokenizer`` (no post-processor or added tokens yet).

    Raises:
        ValueError: a precompiled charsmap that is not a SentencePiece charsmap.
    """
    unk = metadata.get("tokenizer.ggml.unknown_token_id", 2 if len(tokens) > 2 else None)  # llama.cpp's T5 default
    backend = Backend(models.Unigram([(t, float(v)) for t, v in zip(tokens, scores, strict=True)], unk_id=unk))
    steps = []
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if isinstance(charsmap, list) and charsmap:
        blob = bytes(b & 0xFF for b in charsmap)
        check_charsmap(blob)
        try:
            steps.append(normalizers.Precompiled(blob))
        except Exception as err:  # tokenizers raises a bare Exception on a bad map
            raise ValueError(f"tokenizer.ggml.precompiled_charsmap is not a SentencePiece charsmap: {err}") from err
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", False):
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # As SentencePiece: the space prefix always (tokenizers' Metaspace skips it before a leading space), then every
    # space a visible one, and a piece starts at each of them.
    steps += [normalizers.Prepend(SPACE)] if add_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    backend.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always" if add_prefix else "never")
    return backend


def check_charsmap(blob: bytes) -> None:
    """Walk SentencePiece's precompiled charsmap (a u32 trie size, a darts-clone double-array trie, then the
    NUL-terminated replacement strings) and check that no lookup can leave it: ``tokenizers`` indexes it unchecked
    and panics (an uncatchable crash) on a map whose offsets or values point outside.

    Args:
        blob: the map's bytes (``tokenizer.ggml.precompiled_charsmap``).

    Raises:
        ValueError: a trie size or an offset or value that runs past the map.
    """
    bad = ValueError("tokenizer.ggml.precompiled_charsmap is not a SentencePiece charsmap: a trie offset or value "
                     "points outside it")
    if len(blob) < 4:
        raise bad
    size = int.from_bytes(blob[:4], "little")
    if size % 4 or size < 4 or 4 + size > len(blob):
        raise bad
    units = np.frombuffer(blob, dtype="<u4", count=size // 4, offset=4).astype(np.int64)
    strings = blob[4 + size:]
    n = len(units)
    offsets = (units >> 10) << ((units & (1 << 9)) >> 6)
    labels = units & ((1 << 31) | 0xFF)
    codes = np.arange(1, 256)
    pending, seen = [int(offsets[0])], set()
    while pending:  # every node a lookup can reach: its 255 possible children must lie inside the array
        base = pending.pop()
        if base in seen:
            continue
        seen.add(base)
        if base | 0xFF >= n:
            raise bad
        slots = base ^ codes
        for slot in slots[labels[slots] == codes].tolist():
            child = slot ^ int(offsets[slot])
            if child >= n:
                raise bad
            if (units[slot] >> 8) & 1:  # a leaf: the unit at the child holds an index into the strings
                start = int(units[child] & ((1 << 31) - 1))
                if start >= len(strings) or strings.find(b"\0", start) < 0:
                    raise bad
            pending.append(child)
