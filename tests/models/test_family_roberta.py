"""RoBERTa checkpoints against ``transformers`` (logits with fairseq positions, export, refusals)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import models
from models.convert import from_transformers, save_transformers, to_transformers
from tests.models import family_harness
from tests.models.family_harness import assert_logits_close, build_hf, check_encoder_family, convert_via_folder

VOCAB = 97  # odd, prime
PAD = 1
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
            max_position_embeddings=40, pad_token_id=PAD, bos_token_id=0, eos_token_id=2, type_vocab_size=1)


@pytest.fixture
def export_as_roberta(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the harness's export write ``roberta``: BERT, the first exporter by name, represents the same
    ``EncoderLM`` too, so the default export would be a BERT checkpoint."""
    monkeypatch.setattr(family_harness, "save_transformers", functools.partial(save_transformers, model_type="roberta"))


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(tie_word_embeddings=False, type_vocab_size=2, hidden_act="relu"),
], ids=["tied", "untied-segments-relu"])
def test_roberta(overrides: dict, tmp_path: Path, export_as_roberta: None) -> None:
    hf = build_hf("RobertaConfig", "RobertaForMaskedLM", **{**BASE, **overrides})
    # Ids above the pad id: without a mask, transformers would give pad tokens the padding position.
    zoo = check_encoder_family(hf, tmp_path, VOCAB, length=20, low=PAD + 1)
    assert zoo.config.max_len == BASE["max_position_embeddings"] - PAD - 1


@torch.no_grad()
@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_tokens_take_no_position(side: str, tmp_path: Path) -> None:
    """transformers numbers positions from ``input_ids != pad`` (mask or not); the zoo from the attention mask.
    With pad tokens exactly at the masked positions both give every real token the same position."""
    hf = build_hf("RobertaConfig", "RobertaForMaskedLM", **BASE)
    zoo = convert_via_folder(hf, tmp_path)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(PAD + 1, VOCAB, (3, 17), generator=gen)
    mask = torch.ones_like(ids)
    for row, n_pad in ((1, 4), (2, 9)):
        cols = slice(17 - n_pad, None) if side == "right" else slice(0, n_pad)
        ids[row, cols], mask[row, cols] = PAD, 0
    expected = hf(input_ids=ids, attention_mask=mask).logits
    for backend in ("sdpa", "math"):
        zoo.set_attention_backend(backend)
        assert_logits_close(expected, zoo(ids, attention_mask=mask.bool()).logits, mask)
    # A padded row computes what the sequence alone computes (the same positions as an unpadded row).
    alone = ids[2][mask[2].bool()][None]
    assert_logits_close(hf(input_ids=alone).logits[0], zoo(ids, attention_mask=mask.bool()).logits[2][mask[2].bool()])


def test_position_table_offset_and_export_padding_rows(tmp_path: Path) -> None:
    hf = build_hf("RobertaConfig", "RobertaForMaskedLM", **BASE)
    table = hf.roberta.embeddings.position_embeddings.weight.detach()
    converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    assert torch.equal(converted.state_dict["positional.weight"], table[PAD + 1:])
    model = models.EncoderLM(converted.config).eval()
    model.load_state_dict(converted.state_dict)
    config, state = to_transformers(model, "roberta")
    exported = state["roberta.embeddings.position_embeddings.weight"]
    assert config["max_position_embeddings"] == BASE["max_position_embeddings"]
    assert torch.equal(exported[PAD + 1:], table[PAD + 1:]) and not exported[: PAD + 1].any()


def test_base_model_checkpoint_loads_without_head() -> None:
    hf = build_hf("RobertaConfig", "RobertaModel", **BASE)
    with pytest.warns(UserWarning, match="pooler"):
        converted = from_transformers(hf.config.to_dict(), hf.state_dict())
    assert "mlm_head.dense.weight" in converted.allow_missing
    # Tied: the decoder weight is the word embedding, which the checkpoint has.
    assert converted.state_dict["mlm_head.decoder.weight"] is converted.state_dict["embed_tokens.weight"]


@pytest.mark.parametrize(("change", "match"), [
    (dict(is_decoder=True), "is_decoder"),
    (dict(pad_token_id=None), "pad_token_id"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type"),
    (dict(hidden_act="mish"), "hidden_act"),
])
def test_unrepresentable_configs_are_refused_by_name(change: dict, match: str) -> None:
    hf = build_hf("RobertaConfig", "RobertaForMaskedLM", **BASE)
    with pytest.raises(ValueError, match=match):
        from_transformers({**hf.config.to_dict(), **change}, hf.state_dict())


def test_export_refuses_what_roberta_cannot_represent(tmp_path: Path) -> None:
    model = models.EncoderLM.from_preset("roberta-tiny", pad_token_id=None)
    with pytest.raises(ValueError, match="pad_token_id"):
        save_transformers(model, tmp_path / "out", "roberta")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="positional"):
        to_transformers(models.EncoderLM.from_preset("roberta-tiny", positional="rotary"), "roberta")


def test_preset_exports_to_roberta_and_back() -> None:
    torch.manual_seed(0)
    model = models.EncoderLM.from_preset("roberta-tiny").eval()
    config, state = to_transformers(model, "roberta")
    back = from_transformers(config, state)
    assert back.config == model.config
    reloaded = models.EncoderLM(back.config).eval()
    reloaded.load_state_dict(back.state_dict)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert models.EncoderLM.preset_config("roberta-base").max_len == 512
