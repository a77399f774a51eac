"""Collators: turn a list of examples into the batch dict a model's ``forward`` takes.

Examples are texts (encoded with the collator's tokenizer and its post-processing template), id sequences
(lists or 1-D tensors), or dicts with ``input_ids`` (and ``word_ids`` for whole-word masking). Every batch
carries ``(B, L)`` bool masks, True = real token, and ``labels`` with -100 where nothing is predicted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from tokenization import Tokenizer

IGNORE_INDEX = -100


class MLMCollator:
    """Masked-language-model batches (BERT §3.1): 15% of the real, non-special tokens are chosen; of those
    80% become ``[MASK]``, 10% a random non-special token and 10% stay as they are. Labels hold the original
    ids at chosen positions and -100 elsewhere. With ``whole_word_mask`` words are chosen instead of
    tokens, and every token of a chosen word is predicted.

    Args:
        tokenizer: encodes text examples and supplies the ids below (optional for id examples).
        pad_token_id: the padding id (default: the tokenizer's).
        mask_token_id: the ``[MASK]`` id (default: the tokenizer's).
        vocab_size: the range random replacements are drawn from (default: the tokenizer's).
        special_ids: ids never masked (default: the tokenizer's special tokens).
        mlm_probability: the share of tokens (or words) chosen.
        mask_replace_prob: the share of chosen tokens replaced by ``[MASK]``.
        random_replace_prob: the share of chosen tokens replaced by a random token; the rest stay unchanged.
        whole_word_mask: choose words; needs text examples or ``word_ids`` in dict examples.
        max_length: truncate encoded texts to this many tokens.
        generator: the random source (default: torch's global generator, which the Trainer checkpoints).

    Raises:
        ValueError: probabilities outside [0, 1] or summing over 1, or missing ids.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        pad_token_id: int | None = None,
        mask_token_id: int | None = None,
        vocab_size: int | None = None,
        special_ids: Sequence[int] | None = None,
        mlm_probability: float = 0.15,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
        whole_word_mask: bool = False,
        max_length: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        for name, p in (("mlm_probability", mlm_probability), ("mask_replace_prob", mask_replace_prob),
                        ("random_replace_prob", random_replace_prob)):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
        if mask_replace_prob + random_replace_prob > 1.0:
            raise ValueError(
                f"mask_replace_prob + random_replace_prob must be <= 1, got {mask_replace_prob} + {random_replace_prob}"
            )
        self.tokenizer = tokenizer
        self.pad_token_id = _pick(pad_token_id, tokenizer, "pad_token_id")
        self.mask_token_id = _pick(mask_token_id, tokenizer, "mask_token_id")
        self.vocab_size = _pick(vocab_size, tokenizer, "vocab_size")
        if special_ids is None:
            special_ids = (tokenizer.all_special_ids if tokenizer is not None
                           else [self.pad_token_id, self.mask_token_id])
        self.special_ids = sorted(set(special_ids))
        replaceable = torch.ones(self.vocab_size, dtype=torch.bool)
        replaceable[[i for i in self.special_ids if 0 <= i < self.vocab_size]] = False
        if not replaceable.any():
            raise ValueError("every id is special; random replacement has nothing to draw from")
        self._random_pool = replaceable.nonzero().squeeze(-1)  # the non-special ids
        self.mlm_probability = float(mlm_probability)
        self.mask_replace_prob = float(mask_replace_prob)
        self.random_replace_prob = float(random_replace_prob)
        self.whole_word_mask = bool(whole_word_mask)
        self.max_length = _check_max_length(max_length)
        self.generator = generator

    def __call__(self, examples: Sequence[Any]) -> dict[str, Tensor]:
        """Batch ``examples``.

        Returns:
            ``input_ids`` ``(B, L)`` long (with the replacements), ``attention_mask`` ``(B, L)`` bool,
            ``labels`` ``(B, L)`` long.

        Raises:
            ValueError: an empty batch, an example of an unsupported type, text without a tokenizer, or
                whole-word masking without word ids.
        """
        rows, word_rows = _encode_examples(examples, self.tokenizer, self.max_length, with_words=self.whole_word_mask)
        if self.whole_word_mask and word_rows is None:
            raise ValueError("whole_word_mask needs text examples or dict examples with 'word_ids'")
        input_ids, attention_mask = pad_rows(rows, self.pad_token_id)
        special = torch.isin(input_ids, torch.tensor(self.special_ids, dtype=torch.long))
        candidates = attention_mask & ~special  # never choose padding or special tokens

        gen = self.generator
        if self.whole_word_mask:
            word_ids, _ = pad_rows(word_rows, -1)  # type: ignore[arg-type]
            n_words = int(word_ids.max()) + 1 if word_ids.numel() else 0
            chosen_words = torch.rand((len(word_ids), max(n_words, 1)), generator=gen) < self.mlm_probability
            chosen = candidates & (word_ids >= 0) & chosen_words.gather(1, word_ids.clamp(min=0))
        else:
            chosen = candidates & (torch.rand(input_ids.shape, generator=gen) < self.mlm_probability)

        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        action = torch.rand(input_ids.shape, generator=gen)
        to_mask = chosen & (action < self.mask_replace_prob)
        to_random = chosen & ~to_mask & (action < self.mask_replace_prob + self.random_replace_prob)
        random_ids = self._random_pool[
            torch.randint(len(self._random_pool), input_ids.shape, generator=gen)
        ]
        corrupted = torch.where(to_mask, torch.full_like(input_ids, self.mask_token_id), input_ids)
        corrupted = torch.where(to_random, random_ids, corrupted)
        return {"input_ids": corrupted, "attention_mask": attention_mask, "labels": labels}


class CausalLMCollator:
    """Causal-LM batches: ``labels`` are the inputs (the model shifts them inside), -100 on padding and on
    the first token of every document (nothing in its own document precedes it).

    With ``pack=True`` the batch's documents are concatenated, in order, into rows of exactly
    ``max_length`` tokens (a document may continue on the next row; only the last row is padded), so no
    compute goes to padding. With ``document_ids=True`` the batch also carries ``document_ids`` ``(B, L)``:
    the index of the document piece each token belongs to within its row (-1 on padding), from which
    ``blocks.document_mask(document_ids) & blocks.causal_mask(L)`` keeps attention inside documents.

    Rows packed ahead of time (``packed_examples``) are dicts with ``input_ids`` and ``document_ids``; the
    collator keeps their document boundaries.

    Args:
        tokenizer: encodes text examples (its template adds BOS/EOS) and supplies ``pad_token_id``.
        pad_token_id: the padding id (default: the tokenizer's).
        max_length: row length (required with ``pack``); otherwise longer examples are truncated.
        pack: pack documents into full rows.
        document_ids: also return ``document_ids``.

    Raises:
        ValueError: ``pack`` without ``max_length``, or no pad id.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        pad_token_id: int | None = None,
        max_length: int | None = None,
        pack: bool = False,
        document_ids: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.pad_token_id = _pick(pad_token_id, tokenizer, "pad_token_id")
        self.max_length = _check_max_length(max_length)
        if pack and self.max_length is None:
            raise ValueError("pack=True needs max_length (the length of the packed rows)")
        self.pack = bool(pack)
        self.document_ids = bool(document_ids)

    def __call__(self, examples: Sequence[Any]) -> dict[str, Tensor]:
        """Batch ``examples``.

        Returns:
            ``input_ids`` ``(B, L)`` long, ``attention_mask`` ``(B, L)`` bool, ``labels`` ``(B, L)`` long and,
            if asked, ``document_ids`` ``(B, L)`` long. With packing, ``B`` is the number of rows needed.

        Raises:
            ValueError: an empty batch or unsupported examples.
        """
        docs, _ = _encode_examples(examples, self.tokenizer, None if self.pack else self.max_length)
        if self.pack:
            rows, doc_rows = pack_documents(docs, self.max_length)  # type: ignore[arg-type]
        else:
            rows, doc_rows = docs, [_given_document_ids(e, len(d)) for e, d in zip(examples, docs, strict=True)]
        input_ids, attention_mask = pad_rows(rows, self.pad_token_id)
        document_ids, _ = pad_rows(doc_rows, -1)
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        labels = input_ids.masked_fill(starts | ~attention_mask, IGNORE_INDEX)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if self.document_ids:
            batch["document_ids"] = document_ids
        return batch


class Seq2SeqCollator:
    """Encoder-decoder batches with teacher forcing: the decoder reads the target shifted right behind the
    decoder start token and predicts the target itself (``labels``, -100 on padding).

    Examples are ``(source, target)`` pairs or dicts with ``source`` and ``target``, each a text (encoded
    with the tokenizer; the seq2seq template ends it with EOS) or an id sequence.

    Args:
        tokenizer: encodes texts and supplies ``pad_token_id`` and ``decoder_start_token_id`` (its BOS).
        pad_token_id: the padding id (default: the tokenizer's).
        decoder_start_token_id: the id the decoder starts from (default: the tokenizer's).
        max_source_length: truncate longer sources.
        max_target_length: truncate longer targets.

    Raises:
        ValueError: missing ids.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        pad_token_id: int | None = None,
        decoder_start_token_id: int | None = None,
        max_source_length: int | None = None,
        max_target_length: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.pad_token_id = _pick(pad_token_id, tokenizer, "pad_token_id")
        self.decoder_start_token_id = _pick(decoder_start_token_id, tokenizer, "bos_token_id", "decoder_start_token_id")
        self.max_source_length = _check_max_length(max_source_length)
        self.max_target_length = _check_max_length(max_target_length)

    def __call__(self, examples: Sequence[Any]) -> dict[str, Tensor]:
        """Batch ``examples``.

        Returns:
            ``src_ids``, ``src_mask`` ``(B, S)``; ``tgt_ids``, ``tgt_mask``, ``labels`` ``(B, T)``; ids long,
            masks bool.

        Raises:
            ValueError: an empty batch, an example that is not a pair, or an empty target.
        """
        if not examples:
            raise ValueError("cannot collate an empty batch")
        sources, targets = [], []
        for i, example in enumerate(examples):
            if isinstance(example, dict) and {"source", "target"} <= set(example):
                src, tgt = example["source"], example["target"]
            elif isinstance(example, (tuple, list)) and len(example) == 2:
                src, tgt = example
            else:
                raise ValueError(f"example {i} must be a (source, target) pair or a dict with both, got {example!r}")
            sources.append(src)
            targets.append(tgt)
        src_rows, _ = _encode_examples(sources, self.tokenizer, self.max_source_length)
        tgt_rows, _ = _encode_examples(targets, self.tokenizer, self.max_target_length)
        empty = next((i for i, row in enumerate(tgt_rows) if not row), None)
        if empty is not None:
            raise ValueError(f"example {empty} has an empty target; there is nothing to predict")
        src_ids, src_mask = pad_rows(src_rows, self.pad_token_id)
        labels, tgt_mask = pad_rows(tgt_rows, self.pad_token_id)
        # Teacher forcing: position t reads target[t-1] (the start token at t = 0) and predicts target[t].
        tgt_ids = torch.cat([torch.full_like(labels[:, :1], self.decoder_start_token_id), labels[:, :-1]], dim=1)
        tgt_ids = tgt_ids.masked_fill(~tgt_mask, self.pad_token_id)
        labels = labels.masked_fill(~tgt_mask, IGNORE_INDEX)
        return {"src_ids": src_ids, "src_mask": src_mask, "tgt_ids": tgt_ids, "tgt_mask": tgt_mask, "labels": labels}


# ---------------------------------------------------------------------------------------------------------
def pack_documents(docs: Sequence[Sequence[int]], length: int) -> tuple[list[list[int]], list[list[int]]]:
    """Concatenate documents, in order, into rows of ``length`` tokens (the last row may be shorter).

    Args:
        docs: token-id sequences.
        length: the row length.

    Returns:
        ``(rows, document_ids)``: the rows, and for each token the index of its document piece within its
        row (0, 1, ...); a document cut at a row end continues as piece 0 of the next row.

    Raises:
        ValueError: ``length`` < 1.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive integer, got {length!r}")
    rows: list[list[int]] = [[]]
    doc_rows: list[list[int]] = [[]]
    for doc in docs:
        doc = list(doc)
        while doc:
            if len(rows[-1]) == length:
                rows.append([])
                doc_rows.append([])
            room = length - len(rows[-1])
            piece = doc_rows[-1][-1] + 1 if doc_rows[-1] else 0
            rows[-1].extend(doc[:room])
            doc_rows[-1].extend([piece] * len(doc[:room]))
            doc = doc[room:]
    if not rows[-1]:
        rows.pop()
        doc_rows.pop()
    return rows, doc_rows


def packed_examples(docs: Sequence[Sequence[int]], length: int) -> list[dict[str, list[int]]]:
    """Pack a whole corpus ahead of time into examples of ``length`` tokens for ``CausalLMCollator``
    (GPT-style training on a token stream); the last, shorter row is dropped so every row is full.

    Args:
        docs: the documents' ids, in order.
        length: tokens per example.

    Returns:
        A list of ``{"input_ids": [...], "document_ids": [...]}``.

    Raises:
        ValueError: ``length`` < 1, or fewer than ``length`` tokens in all.
    """
    rows, doc_rows = pack_documents(docs, length)
    if rows and len(rows[-1]) < length:
        rows, doc_rows = rows[:-1], doc_rows[:-1]
    if not rows:
        raise ValueError(f"the documents hold fewer than length={length} tokens; nothing to pack")
    return [{"input_ids": r, "document_ids": d} for r, d in zip(rows, doc_rows, strict=True)]


def pad_rows(rows: Sequence[Sequence[int]], pad_value: int) -> tuple[Tensor, Tensor]:
    """Right-pad rows to the longest.

    Args:
        rows: id lists.
        pad_value: the id padding takes.

    Shapes: -> ids ``(B, L)``, mask ``(B, L)``.

    Returns:
        ``(ids (B, L) long, mask (B, L) bool)`` with True on real entries.

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("cannot collate an empty batch")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, : len(row)] = True
    return ids, mask


def _encode_examples(
    examples: Sequence[Any], tokenizer: Tokenizer | None, max_length: int | None, with_words: bool = False
) -> tuple[list[list[int]], list[list[int]] | None]:
    """Id rows (and word-id rows when asked and available) of texts, id sequences or dicts."""
    if not examples:
        raise ValueError("cannot collate an empty batch")
    if all(isinstance(e, str) for e in examples):
        if tokenizer is None:
            raise ValueError("text examples need a tokenizer; pass tokenizer= or give token ids")
        enc = tokenizer(list(examples), padding=False, truncation=max_length is not None, max_length=max_length,
                        return_tensors=None, return_word_ids=with_words)
        return enc["input_ids"], enc.get("word_ids")
    rows, words = [], []
    for i, example in enumerate(examples):
        word_ids = None
        if isinstance(example, dict):
            if "input_ids" not in example:
                raise ValueError(f"dict example {i} has no 'input_ids' (keys: {sorted(example)})")
            word_ids, example = example.get("word_ids"), example["input_ids"]
        if isinstance(example, Tensor):
            if example.dim() != 1:
                raise ValueError(f"example {i} must be a 1-D id tensor, got shape {tuple(example.shape)}")
            example = example.tolist()
        if isinstance(example, str) or not isinstance(example, Sequence):
            raise ValueError(f"example {i} must be a text, an id sequence or a dict with 'input_ids', got {example!r}")
        row = list(example)[:max_length]
        rows.append(row)
        words.append(None if word_ids is None else list(word_ids)[: len(row)])
    if with_words and all(w is not None for w in words):
        return rows, words  # type: ignore[return-value]
    return rows, None


def _given_document_ids(example: Any, length: int) -> list[int]:
    """An example's own ``document_ids`` (cut like its ids), or one document for the whole row."""
    if isinstance(example, dict) and "document_ids" in example:
        given = example["document_ids"]
        given = given.tolist() if isinstance(given, Tensor) else list(given)
        if len(given) < length:
            raise ValueError(f"document_ids has {len(given)} entries for {length} input_ids")
        return given[:length]
    return [0] * length


def _pick(value: int | None, tokenizer: Tokenizer | None, attribute: str, name: str | None = None) -> int:
    name = name or attribute
    if value is None and tokenizer is not None:
        value = getattr(tokenizer, attribute)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer (give it or a tokenizer that has one), got {value!r}")
    return value


def _check_max_length(max_length: int | None) -> int | None:
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
    return max_length


#: The (ids, padding mask) key pairs of the batches the collators build, for every model class.
INPUT_KEYS = (("input_ids", "attention_mask"), ("src_ids", "src_mask"), ("tgt_ids", "tgt_mask"))


def input_tokens(batch: Mapping[str, Any]) -> int:
    """Real input tokens of a collated batch (what the Trainer's tokens/s counts): the unmasked entries of each id
    tensor, or all of them when the batch has no mask for it.

    Args:
        batch: a collated batch.

    Returns:
        The count.
    """
    total = 0
    for ids, mask in INPUT_KEYS:
        if ids in batch:
            total += int(batch[mask].sum()) if mask in batch else batch[ids].numel()
    return total
