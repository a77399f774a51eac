"""Built-in corpus (standard-library docstrings, cached), user files, the hash split, synthetic tasks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from training import SyntheticTask, held_out, load_corpus, split_corpus, stdlib_docstrings
from training.data import read_jsonl

MODULE = '''"""A module docstring that is long enough to be kept as a document here."""


class Widget:
    """Widgets hold a value and know how to describe it in plain words."""

    def describe(self):
        """Short."""


def helper():
    """Return the answer to a question that nobody remembers asking anymore."""
'''


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "pydoc_data").mkdir()
    (root / "pkg" / "widgets.py").write_text(MODULE)
    (root / "test" / "test_widgets.py").write_text('"""Tests are skipped even though this docstring is long."""')
    (root / "broken.py").write_text("def (:\n")
    (root / "pydoc_data" / "topics.py").write_text(
        "topics = {'for': 'The for statement is used to iterate over the elements of a sequence.'}\n")
    monkeypatch.setenv("TZOO_CACHE", str(tmp_path / "cache"))
    return root


def test_docstrings_are_collected_without_tests_or_short_ones_and_cached(fake_stdlib, tmp_path) -> None:
    docs = stdlib_docstrings(stdlib=fake_stdlib)
    assert docs == [
        "A module docstring that is long enough to be kept as a document here.",
        "Widgets hold a value and know how to describe it in plain words.",
        "Return the answer to a question that nobody remembers asking anymore.",
        "The for statement is used to iterate over the elements of a sequence.",
    ]
    cached = list((tmp_path / "cache").glob("stdlib-docstrings-*.jsonl"))
    assert len(cached) == 1 and read_jsonl(cached[0]) == docs
    (fake_stdlib / "pkg" / "widgets.py").unlink()
    assert stdlib_docstrings(stdlib=fake_stdlib) == docs  # served from the cache
    assert stdlib_docstrings(stdlib=fake_stdlib, cache=False) != docs


def test_user_files_replace_the_built_in_corpus(tmp_path) -> None:
    text = tmp_path / "book.txt"
    text.write_text("First paragraph\nstill first.\n\n\nSecond paragraph.\n", encoding="utf-8")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n", encoding="utf-8")
    assert load_corpus(text) == ["First paragraph\nstill first.", "Second paragraph."]
    assert load_corpus([jsonl, text], text_field="body") == ["one", "two", "First paragraph\nstill first.",
                                                              "Second paragraph."]
    with pytest.raises(ValueError, match=r"docs.jsonl:1 has no string field 'text'"):
        load_corpus(jsonl)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no text"):
        load_corpus(tmp_path / "empty.txt")


def test_split_is_decided_by_content_not_order() -> None:
    docs = [f"document number {i}" for i in range(400)]
    train, val = split_corpus(docs, 0.1)
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert 20 <= len(val) <= 60
    train2, val2 = split_corpus(docs[::-1], 0.1)
    assert set(val2) == set(val)
    with pytest.raises(ValueError, match="val_fraction"):
        split_corpus(docs, 1.0)
    with pytest.raises(ValueError, match="empty"):
        split_corpus(docs[:1], 0.01)


@given(st.sampled_from(["copy", "reverse", "add"]), st.integers(0, 10_000), st.integers(0, 99))
def test_synthetic_examples_have_the_right_answer_and_are_deterministic(task: str, seed: int, index: int) -> None:
    data = SyntheticTask(task, 100, max_len=6, seed=seed)
    source, target = data[index]
    assert source[-1] == 3 and target[-1] == 3
    assert target == data.answer(source) and data[index] == (source, target)
    assert all(5 <= t < data.vocab_size for t in source[:-1] + target[:-1])
    assert len(source) <= data.max_source_length and len(target) <= data.max_target_length
    text = data.decode(source)
    if task == "add":
        a, b = text.split("+")
        assert int(data.decode(target)) == int(a) + int(b)
    elif task == "reverse":
        assert data.decode(target) == text[::-1]
    else:
        assert data.decode(target) == text


def test_held_out_sources_never_occur_in_training() -> None:
    train = SyntheticTask("reverse", 2000, n_symbols=4, min_len=2, max_len=6, seed=0)
    test = held_out(train, 100, seed=1)
    seen = {tuple(s) for s, _ in train}
    assert len(test) == 100 and not any(tuple(s) in seen for s, _ in test)
    assert len({tuple(s) for s, _ in test}) == 100
    with pytest.raises(ValueError, match="must differ"):
        held_out(train, 10, seed=0)
    with pytest.raises(ValueError, match="unseen"):
        held_out(SyntheticTask("copy", 500, n_symbols=2, max_len=3), 50, seed=1)
    with pytest.raises(ValueError, match="unknown task"):
        SyntheticTask("sort", 10)
    with pytest.raises(ValueError, match="min_len"):
        SyntheticTask("copy", 10, min_len=5, max_len=2)


def test_a_jsonl_line_nested_too_deeply_is_a_value_error_naming_the_line(tmp_path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2 is not valid JSON: RecursionError"):
        read_jsonl(path)
