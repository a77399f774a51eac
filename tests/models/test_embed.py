"""Sentence embeddings against sentence-transformers: folders it builds load in the zoo and encode alike, and the
folders the zoo writes load in ``SentenceTransformer``."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers import models as st_models
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers import models as tok_models

import models
from models.tasks import packed_batches

WORDS = [f"w{i}" for i in range(90)]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = len(SPECIALS) + len(WORDS)
MAX_SEQ = 24


def texts(n: int = 13, seed: int = 0) -> list[str]:
    """Sentences of mixed lengths, some longer than the maximum sequence length."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=gen)) for k in lengths]


def save_tokenizer(folder: Path, template: bool) -> None:
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if template:
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
                                     num_attention_heads=5, max_position_embeddings=48, pad_token_id=0)
    transformers.BertModel(config).eval().save_pretrained(folder)
    save_tokenizer(folder, template=True)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)
    transformers.LlamaModel(config).eval().save_pretrained(folder)
    save_tokenizer(folder, template=False)
    return folder


def build_st(base: Path, out: Path, pooling: str, normalize: bool) -> SentenceTransformer:
    transformer = st_models.Transformer(str(base), max_seq_length=MAX_SEQ)
    modules = [transformer, st_models.Pooling(transformer.get_embedding_dimension(), pooling)]
    if normalize:
        modules.append(st_models.Normalize())
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(out))
    return st


def encode(st: SentenceTransformer, sentences: list[str], **kwargs) -> torch.Tensor:
    return st.encode(sentences, batch_size=4, convert_to_tensor=True, **kwargs).cpu()


@pytest.mark.parametrize(("pooling", "normalize"), [("cls", False), ("mean", True), ("max", False),
                                                    ("mean_sqrt_len_tokens", True)])
@torch.no_grad()
def test_sentence_transformers_folder_loads_and_encodes_alike(bert_folder, tmp_path, pooling, normalize) -> None:
    st = build_st(bert_folder, tmp_path / "st", pooling, normalize)
    zoo = models.from_pretrained(tmp_path / "st")
    assert zoo.config.head == "embedding"
    assert zoo.config.options["head"]["max_seq_length"] == MAX_SEQ
    sentences = texts()
    expected = encode(st, sentences)
    torch.testing.assert_close(zoo.embed(sentences, batch_size=4), expected, atol=1e-5, rtol=0)
    # normalize= overrides the folder's choice either way
    flipped = zoo.embed(sentences, batch_size=3, normalize=not normalize)
    if normalize:
        assert not torch.allclose(flipped.norm(dim=-1), torch.ones(len(sentences)))
        torch.testing.assert_close(torch.nn.functional.normalize(flipped, dim=-1), expected, atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(flipped, encode(st, sentences, normalize_embeddings=True), atol=1e-5, rtol=0)
    # and the zoo's folder loads in sentence-transformers with the same vectors
    zoo.save_sentence_transformers(tmp_path / "back")
    again = SentenceTransformer(str(tmp_path / "back"), device="cpu")
    torch.testing.assert_close(encode(again, sentences), expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_decoder_with_last_token_pooling(llama_folder, tmp_path) -> None:
    st = build_st(llama_folder, tmp_path / "st", "lasttoken", True)
    zoo = models.from_pretrained(tmp_path / "st")
    assert isinstance(zoo, models.DecoderLM) and zoo.config.options["head"]["pooling"] == "last"
    sentences = texts(seed=1)
    torch.testing.assert_close(zoo.embed(sentences, batch_size=4), encode(st, sentences), atol=1e-5, rtol=0)
    zoo.save_sentence_transformers(tmp_path / "back")
    again = SentenceTransformer(str(tmp_path / "back"), device="cpu")
    torch.testing.assert_close(encode(again, sentences), encode(st, sentences), atol=1e-5, rtol=0)


def test_packing_fills_rows_up_to_the_longest_text() -> None:
    lengths = [30, 5, 12, 7, 30, 3, 18, 9, 2, 25]
    passes = packed_batches(lengths, batch_size=3)
    assert sorted(i for rows in passes for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= max(lengths) for rows in passes for row in rows)
    assert any(len(row) > 1 for rows in passes for row in rows)
    assert all(sum(map(len, rows)) >= 3 for rows in passes[:-1])  # every pass but the last holds batch_size texts


@torch.no_grad()
def test_packed_embeddings_equal_one_text_at_a_time(bert_folder, tmp_path) -> None:
    build_st(bert_folder, tmp_path / "st", "mean", False)
    zoo = models.from_pretrained(tmp_path / "st")
    sentences = texts(n=9, seed=3)
    alone = torch.cat([zoo.embed([s]) for s in sentences])
    torch.testing.assert_close(zoo.embed(sentences, batch_size=9), alone, atol=1e-5, rtol=0)


def test_a_sentence_transformers_folder_loads_without_warnings(bert_folder, tmp_path) -> None:
    # The base model's pooler and the LM head its conversion ties are never used by a sentence-transformers model:
    # loading says nothing about leaving them out (loading the base model alone still does).
    build_st(bert_folder, tmp_path / "st", "mean", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models.from_pretrained(tmp_path / "st")
    assert [str(w.message) for w in caught] == []
    with pytest.warns(UserWarning, match="leaving out the pooler"):
        models.from_pretrained(bert_folder)
