"""sentence-transformers folders are read strictly: each file as the type sentence-transformers writes, or refused.

The hostile folders start from a valid one written by the zoo's ``save_sentence_transformers`` (which
tests/models/test_embed.py shows sentence-transformers loads with the same vectors), with one file or field made
hostile: ``modules.json = []`` (once read as CLS pooling), ``prompts`` given as a list (once read as pairs of
characters), files that hold a list or a string where an object belongs (once an ``AttributeError``), and a
``max_seq_length`` beyond the model's positions (once loaded, to fail later in ``embed``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers

import models
from tokenization import Tokenizer

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "zoo", "cat", "dog", "bird"]


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    backend = Backend(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    torch.manual_seed(0)
    model = models.EncoderLM.from_preset("tiny", vocab_size=len(WORDS), max_len=32, head="embedding",
                                         options={"head": {"pooling": "mean", "max_seq_length": 16,
                                                           "prompts": {"query": "zoo "}}})
    model.tokenizer = Tokenizer(backend)
    folder = tmp_path_factory.mktemp("st") / "valid"
    model.save_sentence_transformers(folder)
    return folder


def hostile(valid: Path, tmp_path: Path, name: str, change: Any) -> Path:
    """A copy of the valid folder with ``name`` replaced (``change``: the new JSON, or a function of the old)."""
    folder = tmp_path / "hostile"
    shutil.copytree(valid, folder)
    path = folder / name
    data = change(json.loads(path.read_text())) if callable(change) else change
    path.write_text(json.dumps(data))
    return folder


def test_the_valid_folder_loads(valid: Path) -> None:
    options = models.from_pretrained(valid).config.options["head"]
    assert (options["pooling"], options["max_seq_length"], options["prompts"]) == ("mean", 16, {"query": "zoo "})


@pytest.mark.parametrize(("modules", "match"), [
    ([], r"modules\.json lists the modules \[\]"),
    ([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}],
     r"modules\.json lists the modules \['Transformer'\]"),
    ([{"idx": 0, "name": "0", "path": "", "type": 5}], r"modules\.json entry .* must have a string 'type'"),
])
def test_modules_json_without_its_modules_is_refused(valid: Path, tmp_path: Path, modules: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(hostile(valid, tmp_path, "modules.json", modules))


@pytest.mark.parametrize(("change", "match"), [
    (lambda c: {**c, "prompts": ["query", "zoo "]}, r"prompts=\['query', 'zoo '\]; expected an object"),
    (lambda c: {**c, "prompts": {"query": 5}}, r"prompts=\{'query': 5\}; expected an object"),
    (lambda c: {**c, "default_prompt_name": "passage"}, r"default_prompt_name='passage'; expected one of"),
])
def test_prompts_of_the_wrong_shape_are_refused(valid: Path, tmp_path: Path, change: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(hostile(valid, tmp_path, "config_sentence_transformers.json", change))


@pytest.mark.parametrize("name", ["sentence_bert_config.json", "config_sentence_transformers.json",
                                  "tokenizer_config.json", "1_Pooling/config.json"])
@pytest.mark.parametrize("data", [["max_seq_length", 16], "cls"])
def test_a_file_holding_another_json_type_is_refused_by_name(valid: Path, tmp_path: Path, name: str,
                                                             data: Any) -> None:
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')} must hold a JSON object, got "
                                         rf"{type(data).__name__}"):
        models.from_pretrained(hostile(valid, tmp_path, name, data))


@pytest.mark.parametrize(("value", "match"), [
    (33, r"max_seq_length=33 exceeds the model's positions \(max_len=32\)"),
    ("16", r"max_seq_length='16'; expected a positive integer"),
    (0, r"max_seq_length=0; expected a positive integer"),
])
def test_a_max_seq_length_the_model_cannot_embed_is_refused_at_load(valid: Path, tmp_path: Path, value: Any,
                                                                    match: str) -> None:
    folder = hostile(valid, tmp_path, "sentence_bert_config.json", lambda c: {**c, "max_seq_length": value})
    with pytest.raises(ValueError, match=match):
        models.from_pretrained(folder)


def test_a_tokenizer_length_beyond_the_positions_is_capped(valid: Path, tmp_path: Path) -> None:
    """Without sentence_bert_config.json's length, tokenizer_config.json's is used up to the model's positions, as
    sentence-transformers does (min of the two)."""
    folder = hostile(valid, tmp_path, "sentence_bert_config.json", {"do_lower_case": False})
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((folder / "tokenizer_config.json").read_text()), "model_max_length": 10**30}))
    assert models.from_pretrained(folder).config.options["head"]["max_seq_length"] == 32
