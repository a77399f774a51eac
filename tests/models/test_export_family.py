"""A converted model remembers its ``transformers`` family through a zoo checkpoint, and exports as it.

A RoBERTa is also BERT-shaped: exported without ``model_type`` after a round trip through the zoo's own
``save_pretrained``, it is still written as ``RobertaForTokenClassification`` with RoBERTa's names, and
``transformers`` loads every weight of it. A hostile ``transformers_model_type`` in a zoo config is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import models
from models.convert import save_transformers

from .family_harness import build_hf

ROBERTA = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
               max_position_embeddings=20, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
               num_labels=3)


@torch.no_grad()
def test_the_family_survives_a_zoo_checkpoint(tmp_path: Path) -> None:
    hf = build_hf("RobertaConfig", "RobertaForTokenClassification", **ROBERTA)
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf")
    assert zoo.transformers_model_type == "roberta"
    zoo.save_pretrained(tmp_path / "zoo")
    assert json.loads((tmp_path / "zoo" / "config.json").read_text())["transformers_model_type"] == "roberta"
    again = models.from_pretrained(tmp_path / "zoo")
    assert again.transformers_model_type == "roberta"
    save_transformers(again, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == [
        "RobertaForTokenClassification"]
    back, info = transformers.RobertaForTokenClassification.from_pretrained(tmp_path / "export",
                                                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(back.eval()(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_a_model_built_in_the_zoo_has_no_family_recorded(tmp_path: Path) -> None:
    model = models.EncoderLM.from_preset("tiny", vocab_size=50)
    model.save_pretrained(tmp_path / "zoo")
    assert "transformers_model_type" not in json.loads((tmp_path / "zoo" / "config.json").read_text())
    assert models.from_pretrained(tmp_path / "zoo").transformers_model_type is None


@pytest.mark.parametrize("value", [5, ["roberta"], {"a": 1}])
def test_a_hostile_family_entry_is_refused(tmp_path: Path, value: object) -> None:
    models.EncoderLM.from_preset("tiny", vocab_size=50).save_pretrained(tmp_path / "zoo")
    raw = json.loads((tmp_path / "zoo" / "config.json").read_text())
    raw["transformers_model_type"] = value
    (tmp_path / "zoo" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"transformers_model_type=.*expected a transformers model_type string"):
        models.from_pretrained(tmp_path / "zoo")
