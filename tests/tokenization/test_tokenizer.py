"""Tokenizer: training, special-token ids, templates, batching to tensors, round trips and files."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from hypothesis import given
from hypothesis import strategies as st

from tokenization import Tokenizer, train_bpe, train_byte_level_bpe, train_wordpiece

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container; raise an error if it is empty.",
    "A tokenizer splits text into pieces and maps each piece to an integer id.",
    "Héllo wörld, the naïve café serves crème brûlée at noon!",
    "def add(a, b):\n    return a + b  # numbers 0123456789",
] * 8

TRAINERS = {"bpe": train_bpe, "wordpiece": train_wordpiece, "byte_level_bpe": train_byte_level_bpe}


@pytest.fixture(scope="module")
def trained() -> dict[str, Tokenizer]:
    return {name: fn(CORPUS, vocab_size=300, min_frequency=1) for name, fn in TRAINERS.items()}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_default_special_token_ids_match_model_defaults(trained: dict[str, Tokenizer], name: str) -> None:
    tok = trained[name]
    ids = (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id)
    assert ids == (0, 1, 2, 3, 4)
    assert tok.all_special_ids == [0, 1, 2, 3, 4]
    assert tok.vocab_size == len(tok) <= 300


@given(st.text(max_size=60))
def test_byte_level_round_trip_is_exact_for_any_text(text: str) -> None:
    tok = _byte_level()
    assert tok.decode(tok.encode(text)) == text


_BYTE_LEVEL: list[Tokenizer] = []


def _byte_level() -> Tokenizer:
    if not _BYTE_LEVEL:
        _BYTE_LEVEL.append(train_byte_level_bpe(CORPUS, vocab_size=300, min_frequency=1))
    return _BYTE_LEVEL[0]


# WordPiece maps a word with a piece it never saw inside a word to [UNK], so the words come from the corpus.
WORDS = st.lists(
    st.sampled_from(sorted({w for line in CORPUS for w in line.lower().split() if w.isascii() and w.isalpha()})),
    min_size=1, max_size=8,
)


@given(WORDS)
def test_bpe_and_wordpiece_round_trip_words(words: list[str]) -> None:
    text = " ".join(words)
    for tok in (_small("bpe"), _small("wordpiece")):
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert tok.decode(ids) == text


_SMALL: dict[str, Tokenizer] = {}


def _small(name: str) -> Tokenizer:
    if name not in _SMALL:
        _SMALL[name] = TRAINERS[name](CORPUS, vocab_size=300, min_frequency=1)
    return _SMALL[name]


def test_unknown_characters_map_to_unk_in_wordpiece(trained: dict[str, Tokenizer]) -> None:
    tok = trained["wordpiece"]
    assert tok.encode("zzz 漢字", add_special_tokens=False)[-1] == tok.unk_token_id


def test_wordpiece_normalises_case_and_accents(trained: dict[str, Tokenizer]) -> None:
    tok = trained["wordpiece"]
    assert tok.encode("CAFÉ") == tok.encode("cafe")
    assert trained["byte_level_bpe"].encode("CAFÉ") != trained["byte_level_bpe"].encode("cafe")


@pytest.mark.parametrize(
    ("template", "single", "pair"),
    [
        ("encoder", "[BOS] a [EOS]", "[BOS] a [EOS] b [EOS]"),
        ("decoder", "[BOS] a [EOS]", "[BOS] a b [EOS]"),
        ("seq2seq", "a [EOS]", "a [EOS] b [EOS]"),
        ("none", "a", "a b"),
    ],
)
def test_templates_place_special_tokens(template: str, single: str, pair: str) -> None:
    tok = train_wordpiece(CORPUS, vocab_size=300, min_frequency=1, template=template)
    a, b = tok.encode("fox", add_special_tokens=False), tok.encode("dog", add_special_tokens=False)

    def expand(pattern: str) -> list[int]:
        out: list[int] = []
        for part in pattern.split():
            out += {"a": a, "b": b}.get(part) or [tok.token_to_id(part)]
        return out

    assert tok.encode("fox") == expand(single)
    batch = tok(["fox"], ["dog"], return_tensors=None)
    assert batch["input_ids"][0] == expand(pair)
    types = batch["token_type_ids"][0]
    assert types[0] == 0 and types[-1] == (1 if template != "none" or b else 0)


def test_batch_encoding_shapes_masks_and_padding_sides(trained: dict[str, Tokenizer]) -> None:
    tok = trained["bpe"]
    texts = ["the quick brown fox", "dog"]
    right = tok(texts)
    assert right["input_ids"].dtype == torch.long and right["attention_mask"].dtype == torch.bool
    assert right["input_ids"].shape == right["attention_mask"].shape
    lengths = [len(tok.encode(t)) for t in texts]
    assert right["attention_mask"].sum(1).tolist() == lengths
    assert right["input_ids"].shape[1] == max(lengths)
    assert (right["input_ids"][~right["attention_mask"]] == tok.pad_token_id).all()
    assert right["input_ids"][1, : lengths[1]].tolist() == tok.encode("dog")
    left = tok(texts, padding_side="left")
    assert left["input_ids"][1, -lengths[1]:].tolist() == tok.encode("dog")
    assert not left["attention_mask"][1, 0] and left["attention_mask"][1, -1]


def test_truncation_keeps_special_tokens_and_max_length_padding(trained: dict[str, Tokenizer]) -> None:
    tok = trained["byte_level_bpe"]
    out = tok(["the quick brown fox jumps over the lazy dog"], truncation=True, max_length=5)
    ids = out["input_ids"][0].tolist()
    assert len(ids) == 5 and ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    padded = tok(["fox"], padding="max_length", max_length=12)
    assert padded["input_ids"].shape == (1, 12)
    assert padded["attention_mask"][0].sum() == len(tok.encode("fox"))


def test_word_ids_mark_words_and_hide_special_tokens(trained: dict[str, Tokenizer]) -> None:
    tok = trained["wordpiece"]
    out = tok(["quick brownish fox", "dog"], return_word_ids=True)
    words, mask = out["word_ids"], out["attention_mask"]
    assert words.shape == out["input_ids"].shape
    assert words[0, 0] == -1 and (words[~mask] == -1).all()
    real = words[0][words[0] >= 0].tolist()
    assert real == sorted(real) and set(real) == {0, 1, 2}


def test_lists_without_tensors_and_unequal_rows(trained: dict[str, Tokenizer]) -> None:
    tok = trained["bpe"]
    lists = tok(["fox", "the lazy dog"], padding=False, return_tensors=None)
    assert lists["input_ids"] == [tok.encode("fox"), tok.encode("the lazy dog")]
    with pytest.raises(ValueError, match="different lengths"):
        tok(["fox", "the lazy dog"], padding=False)


def test_decode_accepts_tensors_and_batches(trained: dict[str, Tokenizer]) -> None:
    tok = trained["byte_level_bpe"]
    batch = tok(["the fox", "a dog"])
    assert tok.batch_decode(batch["input_ids"]) == ["the fox", "a dog"]
    assert tok.decode(batch["input_ids"][0]) == "the fox"
    assert "[BOS]" in tok.decode(tok.encode("fox"), skip_special_tokens=False)


def test_save_and_load_round_trip(tmp_path, trained: dict[str, Tokenizer]) -> None:
    for name, tok in trained.items():
        path = tmp_path / name / "tokenizer.json"
        path.parent.mkdir()
        tok.save(path)
        assert json.loads((path.parent / "tokenizer_config.json").read_text())["pad_token"] == "[PAD]"
        loaded = Tokenizer.from_file(path)
        assert loaded.special_tokens == tok.special_tokens
        text = "The naïve fox returns a container!"
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.vocab_size == tok.vocab_size


def test_custom_role_names_survive_a_reload(tmp_path) -> None:
    roles = {"pad": "<blank>", "unk": "<?>", "bos": "<go>", "eos": "<stop>", "mask": "<hole>"}
    tok = train_bpe(CORPUS, vocab_size=200, min_frequency=1, special_tokens=roles)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 3)
    tok.save(tmp_path / "tokenizer.json")
    assert Tokenizer.from_file(tmp_path / "tokenizer.json").special_tokens == roles
    (tmp_path / "elsewhere").mkdir()
    tok.save(tmp_path / "elsewhere" / "other.json")  # not a model folder's file: no config, roles by name only
    assert not (tmp_path / "elsewhere" / "tokenizer_config.json").exists()
    assert Tokenizer.from_file(tmp_path / "elsewhere" / "other.json").pad_token_id is None
    assert Tokenizer.from_file(tmp_path / "elsewhere" / "other.json", {"pad": "<blank>"}).pad_token_id == 0


def test_hugging_face_tokenizer_files_load_as_is(tmp_path) -> None:
    import transformers
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        mask_token="<mask>",
    )
    hf.save_pretrained(tmp_path / "hf")
    tok = Tokenizer.from_file(tmp_path / "hf" / "tokenizer.json")
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 1, 2, 4)
    text = "the quick brown fox"
    assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]

    # And ours loads in transformers, with the same ids and roles.
    ours = train_byte_level_bpe(CORPUS, vocab_size=300, min_frequency=1)
    ours.save(tmp_path / "tokenizer.json")
    back = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert back(text)["input_ids"] == ours.encode(text)
    assert back.pad_token_id == ours.pad_token_id and back.mask_token_id == ours.mask_token_id


def test_one_token_may_play_several_roles_when_loaded(tmp_path) -> None:
    # GPT-2's files name <|endoftext|> as bos, eos and unk token.
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet))
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}, "unk_token": "<|endoftext|>"}))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.bos_token_id == tok.eos_token_id == tok.unk_token_id == 0
    assert tok.pad_token_id is None and tok.mask_token_id is None
    assert tok(["fox", "the lazy dog"], padding=False, return_tensors=None)["input_ids"][0] == tok.encode("fox")


def test_backend_padding_and_truncation_settings_survive_calls(trained: dict[str, Tokenizer]) -> None:
    tok = Tokenizer.from_str(trained["bpe"].to_str())
    tok.backend.enable_truncation(7)
    tok.backend.enable_padding(pad_id=0, pad_token="[PAD]", length=9)
    before = (tok.backend.padding, tok.backend.truncation)
    tok(["fox", "the quick brown fox"])
    assert (tok.backend.padding, tok.backend.truncation) == before


def test_training_from_files(tmp_path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(CORPUS), encoding="utf-8")
    from_file = train_byte_level_bpe(files=[path], vocab_size=300, min_frequency=1)
    assert from_file.decode(from_file.encode("the lazy dog")) == "the lazy dog"
    assert from_file.vocab_size > 261


def test_bad_input_is_rejected_before_training(tmp_path, trained: dict[str, Tokenizer]) -> None:
    with pytest.raises(ValueError, match="exactly one of texts"):
        train_bpe(vocab_size=100)
    with pytest.raises(ValueError, match="exactly one of texts"):
        train_bpe(CORPUS, files=[tmp_path / "x"], vocab_size=100)
    with pytest.raises(ValueError, match="single str"):
        train_bpe("some text", vocab_size=100)
    with pytest.raises(FileNotFoundError, match="not found"):
        train_bpe(files=[tmp_path / "missing.txt"], vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 262"):
        train_byte_level_bpe(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="unknown special-token role"):
        train_bpe(CORPUS, special_tokens={"cls": "[CLS]"})
    with pytest.raises(ValueError, match="listed twice"):
        train_bpe(CORPUS, special_tokens={"bos": "[X]", "eos": "[X]"})
    with pytest.raises(ValueError, match="unknown template family"):
        train_bpe(CORPUS, template="gpt")
    with pytest.raises(ValueError, match="needs special token"):
        train_bpe(CORPUS, special_tokens={"bos": None}, template="decoder")
    with pytest.raises(ValueError, match="unicode_form"):
        train_bpe(CORPUS, unicode_form="nfx")
    with pytest.raises(ValueError, match="strip_accents"):
        train_bpe(CORPUS, unicode_form="nfc", strip_accents=True)
    with pytest.raises(ValueError, match="item 1 is int"):
        train_bpe(iter(["fine", 3]), vocab_size=100)
    tok = trained["bpe"]
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        Tokenizer(tok.backend, {"pad": "<nope>"})
    with pytest.raises(ValueError, match="ids must be integers"):
        tok.decode([0, tok.vocab_size])
    with pytest.raises(ValueError, match="need max_length"):
        tok(["fox"], truncation=True)
    with pytest.raises(ValueError, match="padding must be one of"):
        tok(["fox"], padding="longst")
    with pytest.raises(ValueError, match="2 texts but 1 text_pairs"):
        tok(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="list of strings"):
        tok(["a", 3])
    with pytest.raises(ValueError, match="no pad token"):
        Tokenizer(tok.backend, {"pad": None})(["fox"])
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path / "bad.json")


def test_a_tokenizer_config_nested_too_deeply_is_a_value_error_naming_it(trained: dict[str, Tokenizer],
                                                                         tmp_path) -> None:
    trained["bpe"].backend.save(str(tmp_path / "tokenizer.json"))
    config = tmp_path / "tokenizer_config.json"
    config.write_text('{"bos_token": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=rf"{config} is not valid JSON: RecursionError"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")


def test_decoding_counts_the_vocabulary_once_and_again_only_when_it_grew(monkeypatch) -> None:
    """Counting the vocabulary is O(vocabulary) in tokenizers; a stream decodes once per token, so the count is kept.
    A token added to the backend afterwards still decodes, and an id past the end is still refused."""
    tok = train_byte_level_bpe(CORPUS, vocab_size=300, min_frequency=1)
    counts = []
    real = Tokenizer.vocab_size.fget
    monkeypatch.setattr(Tokenizer, "vocab_size", property(lambda self: counts.append(1) or real(self)))
    ids = tok.encode("the quick brown fox " * 20)
    for _ in range(5):
        assert tok.decode(ids) == tok.backend.decode(ids)
    assert len(counts) == 1  # not once per id, nor once per call
    tok.backend.add_tokens([tokenizers.AddedToken("<new>", normalized=False)])
    new = tok.backend.token_to_id("<new>")
    assert tok.decode([new], skip_special_tokens=False) == "<new>"
    with pytest.raises(ValueError, match=rf"ids must be integers in \[0, vocab_size={new + 1}\), got {new + 1}"):
        tok.decode([new + 1])
