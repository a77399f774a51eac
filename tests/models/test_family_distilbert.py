"""DistilBERT checkpoints against ``transformers`` (logits, export, refusals)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, save_transformers, to_transformers
from tests.models import family_harness
from tests.models.family_harness import build_hf, check_encoder_family

VOCAB = 89  # odd, prime
BASE = dict(vocab_size=VOCAB, dim=48, hidden_dim=72, n_layers=2, n_heads=6, max_position_embeddings=32, pad_token_id=0)


@pytest.fixture
def export_as_distilbert(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the harness's export write ``distilbert``: BERT, the first exporter by name, represents the same
    ``EncoderLM`` too (with an all-zero segment embedding), so the default export would be a BERT checkpoint."""
    monkeypatch.setattr(family_harness, "save_transformers",
                        functools.partial(save_transformers, model_type="distilbert"))


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(tie_word_embeddings=False, sinusoidal_pos_embds=True),
], ids=["tied", "untied-sinusoidal"])
def test_distilbert(overrides: dict, tmp_path: Path, export_as_distilbert: None) -> None:
    hf = build_hf("DistilBertConfig", "DistilBertForMaskedLM", **{**BASE, **overrides})
    zoo = check_encoder_family(hf, tmp_path, VOCAB, length=20)
    assert zoo.token_type_embed is None and zoo.config.norm_eps == 1e-12


def test_base_model_checkpoint_loads_without_head() -> None:
    hf = build_hf("DistilBertConfig", "DistilBertModel", **BASE, activation="relu")
    converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    assert converted.config.ffn == "relu"
    assert {"mlm_head.dense.weight", "mlm_head.decoder.bias"} <= converted.allow_missing


@pytest.mark.parametrize(("change", "match"), [
    (dict(activation="relu"), "activation"),  # the MLM head would apply ReLU, the zoo's head GELU
    (dict(activation="mish"), "activation"),
])
def test_unrepresentable_configs_are_refused_by_name(change: dict, match: str) -> None:
    hf = build_hf("DistilBertConfig", "DistilBertForMaskedLM", **BASE)
    with pytest.raises(ValueError, match=match):
        from_transformers({**hf.config.to_dict(), **change}, hf.state_dict())


def test_task_heads_are_refused_by_name() -> None:
    # Multiple choice has no zoo head (sequence/token classification and QA are converted: tests/models/test_heads*).
    hf = build_hf("DistilBertConfig", "DistilBertForMultipleChoice", **BASE)
    with pytest.raises(ValueError, match="classifier"):
        from_transformers({**hf.config.to_dict(), "architectures": ["DistilBertForMultipleChoice"]}, hf.state_dict())


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(type_vocab_size=2), "type_vocab_size"),
    (dict(norm_eps=1e-5), "norm_eps"),
    (dict(ffn="gelu_tanh"), "ffn"),
])
def test_export_refuses_what_distilbert_cannot_represent(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        to_transformers(models.EncoderLM.from_preset("distilbert-tiny", **overrides), "distilbert")


def test_preset_exports_to_distilbert_and_back() -> None:
    torch.manual_seed(0)
    model = models.EncoderLM.from_preset("distilbert-tiny").eval()
    config, state = to_transformers(model, "distilbert")
    back = from_transformers(config, state)
    assert back.config == model.config
    reloaded = models.EncoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert models.EncoderLM.preset_config("distilbert-base-uncased").n_layers == 6
