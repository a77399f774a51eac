"""Collators: MLM statistics (15%, 80/10/10, never special tokens, whole words), causal-LM labels and
packing with document masks, seq2seq teacher forcing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import blocks
from tokenization import train_wordpiece
from training import CausalLMCollator, MLMCollator, Seq2SeqCollator, pack_documents, packed_examples

PAD, UNK, BOS, EOS, MASK = 0, 1, 2, 3, 4
VOCAB = 50


def _mlm(**kw) -> MLMCollator:
    return MLMCollator(pad_token_id=PAD, mask_token_id=MASK, vocab_size=VOCAB,
                       special_ids=[PAD, UNK, BOS, EOS, MASK], generator=torch.Generator().manual_seed(0), **kw)


def _rows(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (n,), generator=g).tolist()
    return [[BOS] + torch.randint(5, VOCAB, (k,), generator=g).tolist() + [EOS] for k in lengths]


def test_mlm_chooses_15_percent_and_splits_80_10_10() -> None:
    rows = _rows(400)
    batch = _mlm()(rows)
    original, _ = _pad(rows)
    labels, ids, mask = batch["labels"], batch["input_ids"], batch["attention_mask"]
    chosen = labels != -100
    real = mask & (original >= 5)
    n_real, n_chosen = int(real.sum()), int(chosen.sum())
    # ~8900 candidate tokens: the binomial standard deviation of each share is well under 1%.
    assert abs(n_chosen / n_real - 0.15) < 0.01
    assert (labels[chosen] == original[chosen]).all()
    masked = (ids == MASK) & chosen
    unchanged = (ids == original) & chosen
    randomised = chosen & ~masked & ~unchanged
    assert abs(masked.sum() / n_chosen - 0.8) < 0.03
    assert abs(unchanged.sum() / n_chosen - 0.1) < 0.025  # includes the rare random draw of the same id
    assert abs(randomised.sum() / n_chosen - 0.1) < 0.025
    assert (ids[randomised] >= 5).all(), "random replacements are never special tokens"
    assert (ids[~chosen] == original[~chosen]).all()


@given(st.integers(0, 2**31 - 1))
def test_mlm_never_chooses_special_or_padding_tokens(seed: int) -> None:
    rows = _rows(6, seed)
    collator = _mlm(mlm_probability=0.9)
    collator.generator = torch.Generator().manual_seed(seed)
    batch = collator(rows)
    original, mask = _pad(rows)
    chosen = batch["labels"] != -100
    assert not (chosen & ~mask).any()
    assert not (chosen & (original < 5)).any()
    assert (batch["input_ids"][original < 5] == original[original < 5]).all()


def test_whole_word_masking_takes_every_piece_of_a_word() -> None:
    words = [[7, 8, 9], [10], [11, 12], [13, 14, 15, 16]]
    ids, word_ids = [BOS], [-1]
    for w, pieces in enumerate(words * 5):
        ids += pieces
        word_ids += [w] * len(pieces)
    ids.append(EOS)
    word_ids.append(-1)
    examples = [{"input_ids": ids, "word_ids": word_ids}] * 200
    batch = _mlm(whole_word_mask=True, mlm_probability=0.3)(examples)
    chosen = batch["labels"] != -100
    word_tensor = torch.tensor(word_ids)
    for row in chosen:
        for w in range(len(words) * 5):
            in_word = row[word_tensor == w]
            assert in_word.all() or not in_word.any()
    share = chosen[:, word_tensor >= 0].float().mean().item()
    assert 0.25 < share < 0.35
    assert not chosen[:, word_tensor < 0].any()


def test_whole_word_masking_from_text_uses_the_tokenizers_words() -> None:
    tok = train_wordpiece(["unbelievable things happen", "believe it or not"] * 20, vocab_size=80, min_frequency=1)
    collator = MLMCollator(tok, whole_word_mask=True, mlm_probability=0.5, generator=torch.Generator().manual_seed(1))
    batch = collator(["unbelievable things happen"] * 50)
    words = tok(["unbelievable things happen"], return_word_ids=True)["word_ids"][0]
    chosen = batch["labels"] != -100
    for w in range(int(words.max()) + 1):
        in_word = chosen[:, words == w]
        assert (in_word.all(1) | ~in_word.any(1)).all()
    with pytest.raises(ValueError, match="word_ids"):
        MLMCollator(tok, whole_word_mask=True)([[5, 6, 7]])


def test_causal_lm_labels_are_the_inputs_without_padding_or_document_starts() -> None:
    batch = CausalLMCollator(pad_token_id=PAD)([[BOS, 5, 6, EOS], [BOS, 7, EOS]])
    assert batch["input_ids"].tolist() == [[BOS, 5, 6, EOS], [BOS, 7, EOS, PAD]]
    assert batch["attention_mask"].tolist() == [[True] * 4, [True, True, True, False]]
    assert batch["labels"].tolist() == [[-100, 5, 6, EOS], [-100, 7, EOS, -100]]
    truncated = CausalLMCollator(pad_token_id=PAD, max_length=3)([[BOS, 5, 6, EOS]])
    assert truncated["input_ids"].tolist() == [[BOS, 5, 6]]


def test_packing_fills_rows_and_document_ids_keep_attention_inside_documents() -> None:
    docs = [[BOS, 5, 6, EOS], [BOS, 7, EOS], [BOS, 8, 9, 10, 11, EOS]]
    batch = CausalLMCollator(pad_token_id=PAD, max_length=5, pack=True, document_ids=True)(docs)
    flat = [t for d in docs for t in d]
    assert batch["input_ids"].flatten()[: len(flat)].tolist() == flat
    assert batch["attention_mask"].sum() == len(flat) and batch["input_ids"].shape == (3, 5)
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0, 1], [0, 0, 1, 1, 1], [0, 0, 0, -1, -1]]
    # A document's first token is never a target; every other real token is.
    assert batch["labels"].tolist() == [[-100, 5, 6, EOS, -100], [-100, EOS, -100, 8, 9], [-100, 11, EOS, -100, -100]]
    mask = blocks.document_mask(batch["document_ids"]) & blocks.causal_mask(5)
    assert mask[0, 0, 4].tolist() == [False, False, False, False, True]  # row 0's second document sees itself only
    assert mask[1, 0, 3].tolist() == [False, False, True, True, False]


def test_packed_examples_keep_their_document_boundaries() -> None:
    docs = [[BOS, 5, 6, EOS], [BOS, 7, EOS], [BOS, 8, EOS]]
    examples = packed_examples(docs, 4)
    assert [e["input_ids"] for e in examples] == [[BOS, 5, 6, EOS], [BOS, 7, EOS, BOS]]  # the short tail is dropped
    batch = CausalLMCollator(pad_token_id=PAD, document_ids=True)(examples)
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 5, 6, EOS], [-100, 7, EOS, -100]]
    with pytest.raises(ValueError, match="fewer than length"):
        packed_examples([[1, 2]], 4)


@given(st.lists(st.lists(st.integers(5, 40), min_size=1, max_size=12), min_size=1, max_size=8), st.integers(1, 10))
def test_pack_documents_preserves_the_token_stream(docs: list[list[int]], length: int) -> None:
    rows, doc_ids = pack_documents(docs, length)
    assert [t for r in rows for t in r] == [t for d in docs for t in d]
    assert all(len(r) == length for r in rows[:-1]) and 0 < len(rows[-1]) <= length
    assert all(len(r) == len(d) for r, d in zip(rows, doc_ids, strict=True))


def test_seq2seq_teacher_forcing_shifts_the_target_right() -> None:
    collator = Seq2SeqCollator(pad_token_id=PAD, decoder_start_token_id=BOS)
    batch = collator([([5, 6, 7, EOS], [8, 9, EOS]), {"source": [5, EOS], "target": [10, EOS]}])
    assert batch["src_ids"].tolist() == [[5, 6, 7, EOS], [5, EOS, PAD, PAD]]
    assert batch["src_mask"].tolist() == [[True] * 4, [True, True, False, False]]
    assert batch["tgt_ids"].tolist() == [[BOS, 8, 9], [BOS, 10, PAD]]
    assert batch["labels"].tolist() == [[8, 9, EOS], [10, EOS, -100]]
    assert batch["tgt_mask"].tolist() == [[True] * 3, [True, True, False]]


def test_seq2seq_from_text_uses_the_seq2seq_template() -> None:
    tok = train_wordpiece(["the cat sat", "le chat assis"] * 10, vocab_size=60, min_frequency=1, template="seq2seq")
    batch = Seq2SeqCollator(tok)([("the cat sat", "le chat assis")])
    target = tok.encode("le chat assis")
    assert target[-1] == tok.eos_token_id
    assert batch["labels"][0].tolist() == target
    assert batch["tgt_ids"][0].tolist() == [tok.bos_token_id] + target[:-1]


def test_collators_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="mlm_probability"):
        _mlm(mlm_probability=1.5)
    with pytest.raises(ValueError, match="<= 1"):
        _mlm(mask_replace_prob=0.8, random_replace_prob=0.3)
    with pytest.raises(ValueError, match="mask_token_id"):
        MLMCollator(pad_token_id=0, vocab_size=10)
    with pytest.raises(ValueError, match="empty batch"):
        _mlm()([])
    with pytest.raises(ValueError, match="need a tokenizer"):
        _mlm()(["some text"])
    with pytest.raises(ValueError, match="pack=True needs max_length"):
        CausalLMCollator(pad_token_id=0, pack=True)
    with pytest.raises(ValueError, match="1-D"):
        CausalLMCollator(pad_token_id=0)([torch.ones(2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="pair"):
        Seq2SeqCollator(pad_token_id=0, decoder_start_token_id=2)([[1, 2, 3]])
    with pytest.raises(ValueError, match="empty target"):
        Seq2SeqCollator(pad_token_id=0, decoder_start_token_id=2)([([5], [])])


def _pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return ids, mask


def test_input_tokens_counts_the_real_tokens_of_every_id_tensor() -> None:
    from training.collators import input_tokens

    batch = {
        "src_ids": torch.zeros(2, 5, dtype=torch.long),
        "src_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),
        "tgt_ids": torch.zeros(2, 3, dtype=torch.long),  # no mask: every entry counts
        "labels": torch.zeros(2, 3, dtype=torch.long),  # not an input
    }
    assert input_tokens(batch) == 3 + 5 + 6
    assert input_tokens({"input_ids": torch.zeros(4, 7, dtype=torch.long)}) == 28
