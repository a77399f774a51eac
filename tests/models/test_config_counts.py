"""Every count field of every family's config is bounded before anything is built from it.

Experts (``num_local_experts``, ``num_experts``, ``n_routed_experts``), labels (``num_labels``, the size of
``id2label``), widths, heads and positions: a config claiming more than its checkpoint stores is refused with a
``ValueError`` naming the field, before a converter loops over the experts, a label map is built or a model is
built (even on the meta device). The hostile checkpoints are valid ones from a real writer (the zoo's exporter for
every family with a ``*-tiny`` preset, ``transformers``' ``save_pretrained``, the zoo's ``save_pretrained``) with one
field made hostile; the registry-wide test covers every registered converter, presets or not.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # a dev dependency: missing, the suite must fail here, not skip

import models
from models import DecoderLM, EncoderLM, Seq2SeqTransformer
from models.convert.bounds import HF_COUNT_FIELDS, HF_POSITION_FIELDS, MAX_POSITIONS
from models.convert.export import to_transformers
from models.convert.registry import from_transformers, supported_model_types

HUGE = 10**12
TINY_PRESETS = sorted(
    (cls.__name__, name) for cls in (DecoderLM, EncoderLM) for name in cls.presets if name.endswith("tiny")
)


def exported(cls_name: str, preset: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``transformers`` config and state dict the zoo's exporter writes for a family's tiny preset."""
    cls = {"DecoderLM": DecoderLM, "EncoderLM": EncoderLM}[cls_name]
    torch.manual_seed(0)
    family = preset.removesuffix("-tiny")
    return to_transformers(cls.from_preset(preset), family if family in supported_model_types() else None)


@pytest.mark.parametrize(("cls_name", "preset"), TINY_PRESETS)
def test_every_count_field_of_every_family_is_bounded(cls_name: str, preset: str) -> None:
    config, state = exported(cls_name, preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_transformers(config, state)  # the valid export converts
    fields = [f for f in (*HF_COUNT_FIELDS, *HF_POSITION_FIELDS) if isinstance(config.get(f), int)]
    assert fields, config
    for field in fields:
        with pytest.raises(ValueError, match=rf"{config['model_type']} config field {field}={HUGE}\b"):
            from_transformers({**config, field: HUGE}, state)


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_registered_converter_checks_counts_first(model_type: str) -> None:
    """Whatever the family, the guard runs before its converter: a hostile count with a one-tensor state dict is
    refused naming the count (the converter would otherwise complain about the missing tensors)."""
    state = {"model.layers.0.w": torch.zeros(8, 4)}
    for field in (*HF_COUNT_FIELDS, *HF_POSITION_FIELDS):
        with pytest.raises(ValueError, match=rf"config field {field}={HUGE}\b"):
            from_transformers({"model_type": model_type, field: HUGE}, state)
    labels = {str(i): f"L{i}" for i in range(9)}  # one more label than the largest dimension stored
    with pytest.raises(ValueError, match=r"config field id2label \(its size\)=9\b"):
        from_transformers({"model_type": model_type, "id2label": labels}, state)


def test_counts_within_what_is_stored_pass() -> None:
    state = {"model.layers.0.w": torch.zeros(8, 4)}
    with pytest.raises(ValueError) as refused:  # refused for its missing tensors, not for its counts
        from_transformers({"model_type": "llama", "num_attention_heads": 8, "max_position_embeddings": MAX_POSITIONS},
                          state)
    assert "exceeds" not in str(refused.value)


# ---------------------------------------------------------------------------------- transformers' own writer
def edit(folder: Path, **fields: Any) -> None:
    raw = json.loads((folder / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))


SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)
BUILDERS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, num_local_experts=3, num_experts_per_tok=2)),
    "bert": lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32, num_labels=3)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
}
_SAVED: dict[str, Path] = {}


def saved_copy(family: str, tmp_path: Path, root: Path) -> Path:
    """A copy (in ``tmp_path``) of a tiny ``transformers`` checkpoint written once per family by ``save_pretrained``."""
    if family not in _SAVED:
        torch.manual_seed(0)
        BUILDERS[family]().save_pretrained(root / family)
        _SAVED[family] = root / family
    folder = tmp_path / family
    folder.mkdir()
    for file in _SAVED[family].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.mark.parametrize(
    ("family", "fields", "named"),
    [
        ("mixtral", {"num_local_experts": 10**9}, "num_local_experts=1000000000"),
        ("bert", {"num_labels": 10**9, "id2label": None, "label2id": None}, "num_labels=1000000000"),
        ("bert", {"id2label": {str(i): f"L{i}" for i in range(5000)}}, r"id2label \(its size\)=5000"),
        ("bert", {"label2id": {f"L{i}": i for i in range(5000)}}, r"label2id \(its size\)=5000"),
        ("llama", {"max_position_embeddings": 10**12}, "max_position_embeddings=1000000000000"),
    ],
)
def test_a_hostile_count_from_save_pretrained_is_refused(
    root: Path, tmp_path: Path, family: str, fields: dict[str, Any], named: str
) -> None:
    folder = saved_copy(family, tmp_path, root)
    edit(folder, **fields)
    with pytest.raises(ValueError, match=named):
        models.from_pretrained(folder)


def test_a_huge_label_map_is_refused_unread(root: Path, tmp_path: Path) -> None:
    """A config.json over 4 MiB (label names of 5 kB each) is refused by its size before it is parsed."""
    folder = saved_copy("bert", tmp_path, root)
    edit(folder, id2label={str(i): "L" * 5000 for i in range(1000)}, label2id=None, num_labels=None)
    with pytest.raises(ValueError, match=r"config\.json holds [\d,]+ bytes of JSON; expected at most 4,194,304"):
        models.from_pretrained(folder)


# ---------------------------------------------------------------------------------- the zoo's own writer
def zoo_saved(tmp_path: Path, model: torch.nn.Module, path: tuple[str, ...], value: Any) -> Path:
    folder = tmp_path / "zoo"
    model.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    node = raw["config"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("options", "ffn", "n_experts"), 10**9, r"options\['ffn'\]\.n_experts=1000000000"),
        (("options", "ffn", "top_k"), 10**9, r"options\['ffn'\]\.top_k=1000000000"),
        (("max_len",), MAX_POSITIONS + 1, rf"max_len={MAX_POSITIONS + 1}"),
    ],
)
def test_a_hostile_count_in_a_zoo_checkpoint_is_refused(
    tmp_path: Path, path: tuple[str, ...], value: Any, named: str
) -> None:
    torch.manual_seed(0)
    folder = zoo_saved(tmp_path, DecoderLM.from_preset("mixtral-tiny", vocab_size=50), path, value)
    with pytest.raises(ValueError, match=named):
        models.from_pretrained(folder)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("num_labels", 10**9, r"options\['head'\]\.num_labels=1000000000"),
        # the head's own check refuses a map of another size by its length
        ("id2label", {str(i): f"L{i}" for i in range(5000)}, r"id2label has ids for 5000 labels, which do not match"),
    ],
)
def test_a_hostile_label_count_in_a_zoo_checkpoint_is_refused(tmp_path: Path, key: str, value: Any,
                                                              named: str) -> None:
    torch.manual_seed(0)
    model = EncoderLM.from_preset("tiny", vocab_size=50, head="sequence_classification",
                                  options={"head": {"num_labels": 3}})
    folder = zoo_saved(tmp_path, model, ("options", "head", key), value)
    with pytest.raises(ValueError, match=named):
        models.from_pretrained(folder)


def test_label_maps_are_sized_before_they_are_compared() -> None:
    """The head's own check: a map of the wrong size is refused by its length (not by listing every id)."""
    with pytest.raises(ValueError, match="id2label has ids for 3 labels, which do not match num_labels=1000000000"):
        EncoderLM.from_preset("tiny", head="sequence_classification",
                              options={"head": {"num_labels": 10**9, "id2label": {"0": "a", "1": "b", "2": "c"}}})


def test_max_len_is_bounded_in_every_config() -> None:
    with pytest.raises(ValueError, match=rf"max_len={MAX_POSITIONS + 1} exceeds MAX_POSITIONS"):
        Seq2SeqTransformer.config_class(max_len=MAX_POSITIONS + 1)
