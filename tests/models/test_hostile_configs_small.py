"""Smaller hostile inputs of issue 38, each refused with a ``ValueError`` naming the field or argument.

Configs come from a real writer (the zoo's exporter, whose output ``transformers`` loads, or the zoo's
``save_pretrained``) with one field made hostile; the task helpers get a hostile argument.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models as tok_models
from tokenizers import pre_tokenizers, processors

import models
from models import DecoderLM, EncoderLM
from models.convert.export import to_transformers
from models.convert.registry import from_transformers
from tokenization import Tokenizer


def exported(preset: str, family: str) -> tuple[dict, dict]:
    torch.manual_seed(0)
    return to_transformers(DecoderLM.from_preset(preset), family)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_norm_topk_prob_must_be_a_boolean(family: str, value: object) -> None:
    config, state = exported(f"{family}-tiny", family)
    with pytest.raises(ValueError, match=rf"{family} config field norm_topk_prob must be true or false, got {value!r}"):
        from_transformers({**config, "norm_topk_prob": value}, state)


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_a_rope_setting_that_is_no_object_is_named(field: str) -> None:
    config, state = exported("llama-tiny", "llama")
    with pytest.raises(ValueError, match=rf"llama config field {field} must be an object .* got 'linear'"):
        from_transformers({**config, field: "linear"}, state)


def test_longrope_original_length_above_the_maximum_is_refused() -> None:
    config, state = exported("phi3-tiny", "phi3")
    half = config["head_dim"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half, "long_factor": [2.0] * half,
            "original_max_position_embeddings": 4096}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_transformers({**config, "rope_parameters": {**rope, "original_max_position_embeddings": 64},
                           "original_max_position_embeddings": 64}, state)  # the valid one converts
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=4096 exceeds max_position_embeddings=256"):
        from_transformers({**config, "rope_parameters": rope, "original_max_position_embeddings": 4096}, state)


@pytest.mark.parametrize("value", [-1e-6, 0.0])
def test_a_non_positive_qk_norm_eps_is_refused_at_load(tmp_path: Path, value: float) -> None:
    DecoderLM.from_preset("qwen3-tiny", vocab_size=50).save_pretrained(tmp_path / "zoo")
    raw = json.loads((tmp_path / "zoo" / "config.json").read_text())
    raw["config"]["options"]["attention"]["qk_norm_eps"] = value
    (tmp_path / "zoo" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"qk_norm_eps must be a finite number > 0, got {value!r}"):
        models.from_pretrained(tmp_path / "zoo")


# ---------------------------------------------------------------------------------------------- task helpers
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *[f"w{i}" for i in range(20)]]


def tokenizer() -> Tokenizer:
    backend = Backend(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return Tokenizer(backend)


def task_model(head: str) -> EncoderLM:
    torch.manual_seed(0)
    model = EncoderLM.from_preset("tiny", vocab_size=len(WORDS), max_len=16, head=head).eval()
    model.tokenizer = tokenizer()
    return model


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_seq_len": 1}, r"the question takes 2 tokens, which leaves no room for the context in max_seq_len=1"),
    ({"question": " ".join(["w1"] * 20)}, r"the question takes 20 tokens, which leaves no room .* max_seq_len=16"),
    ({"stride": 11}, r"stride=11 must be smaller than the 11 context tokens"),
])
def test_answer_refuses_windows_without_room_for_the_context(kwargs: dict, match: str) -> None:
    model = task_model("question_answering")
    arguments = {"question": "w1 w2", "context": " ".join(f"w{i % 20}" for i in range(40)), **kwargs}
    with pytest.raises(ValueError, match=match):
        model.answer(**arguments)
    assert model.answer("w1 w2", "w3 w4 w5")["answer"]  # a window with room answers


@pytest.mark.parametrize(("texts", "kwargs", "match"), [
    (5, {}, r"texts must be a string or a non-empty list of strings, got int 5"),
    (["w1", 5], {}, r"texts must be a string or a non-empty list of strings, got int 5"),
    ([], {}, r"texts must be a string or a non-empty list of strings, got list \[\]"),
    ("w1", {"batch_size": 0}, r"batch_size must be a positive integer, got 0"),
])
def test_classify_names_the_bad_argument(texts: object, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        task_model("sequence_classification").classify(texts, **kwargs)


def test_tag_names_the_bad_argument() -> None:
    with pytest.raises(ValueError, match=r"texts must be a string or a non-empty list of strings, got int 5"):
        task_model("token_classification").tag(5)
