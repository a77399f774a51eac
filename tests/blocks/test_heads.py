"""The registered heads: pooling against brute force, options validated, labels checked, configs round-tripped."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import blocks
from blocks.heads import POOLINGS, pool
from models import DecoderLM, DecoderLMConfig, EncoderLM, EncoderLMConfig

TASK_HEADS = ["sequence_classification", "token_classification", "question_answering", "embedding"]


def brute_pool(x: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    rows = []
    for row, keep in zip(x, mask, strict=True):
        real = row[keep]
        rows.append({"cls": real[0], "last": real[-1], "mean": real.mean(0), "max": real.max(0).values,
                     "mean_sqrt_len": real.sum(0) / len(real) ** 0.5}[pooling])
    return torch.stack(rows)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_pooling_matches_brute_force(pooling: str, side: str) -> None:
    x = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 6, dtype=torch.bool)
    if side == "right":
        mask[1, 4:] = mask[2, 2:] = False
    else:
        mask[1, :2] = mask[2, :4] = False
    torch.testing.assert_close(pool(x, mask, pooling), brute_pool(x, mask, pooling))
    torch.testing.assert_close(pool(x, None, pooling), brute_pool(x, torch.ones_like(mask), pooling))


def test_unknown_pooling_raises() -> None:
    with pytest.raises(ValueError, match="pooling 'avg'.*expected one of"):
        pool(torch.zeros(1, 2, 3), None, "avg")
    with pytest.raises(ValueError, match="pooling 'avg'"):
        EncoderLMConfig(head="embedding", options={"head": {"pooling": "avg"}})


@pytest.mark.parametrize("cls", [EncoderLMConfig, DecoderLMConfig])
@pytest.mark.parametrize("head", TASK_HEADS)
def test_head_configs_round_trip_through_json(cls, head: str) -> None:
    options = {"embedding": {"pooling": "max", "normalize": True},
               "question_answering": {"classifier_dropout": 0.2}}.get(head, {
                   "num_labels": 2, "id2label": {0: "no", 1: "yes"}, "label2id": {"no": 0, "yes": 1}})
    config = cls(head=head, options={"head": options})
    again = cls.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.head == head
    if "id2label" in options:
        assert again.options["head"]["id2label"] == {"0": "no", "1": "yes"}


@pytest.mark.parametrize(("options", "match"), [
    ({"num_labels": 0}, "num_labels must be a positive integer, got 0"),
    ({"num_labels": -2}, "num_labels must be a positive integer, got -2"),
    ({"num_labels": 3, "id2label": {"0": "a", "1": "b"}}, "id2label has ids.*num_labels=3"),
    ({"num_labels": 2, "label2id": {"a": 0, "b": 5}}, "label2id maps to ids.*num_labels=2"),
    ({"num_labels": 2, "id2label": {"0": "a", "1": "b"}, "label2id": {"a": 1, "b": 0}}, "not the inverse"),
    ({"problem_type": "ranking"}, "problem_type 'ranking'"),
    ({"pre_classifier": "xlnet"}, "pre_classifier 'xlnet'"),
    ({"classifier_dropout": 1.5}, "classifier_dropout.*1.5"),
    ({"num_labels": "3"}, "'num_labels'.*got '3'"),
    ({"colour": "red"}, "unknown config key.*colour"),
])
def test_bad_head_options_raise(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        EncoderLMConfig(head="sequence_classification", options={"head": options})


def test_heads_a_class_cannot_use_raise() -> None:
    with pytest.raises(ValueError, match="head 'lm' does not fit a EncoderLM.*'mlm'"):
        EncoderLMConfig(head="lm")
    with pytest.raises(ValueError, match="head 'mlm' does not fit a DecoderLM"):
        DecoderLMConfig(head="mlm")
    with pytest.raises(ValueError, match="unknown head 'regression'"):
        EncoderLMConfig(head="regression", options={"head": {}})


SMALL = dict(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=16, dropout=0.0)


@pytest.fixture(scope="module")
def classifier() -> EncoderLM:
    return EncoderLM(EncoderLMConfig(**SMALL, head="sequence_classification",
                                     options={"head": {"num_labels": 3}})).eval()


@pytest.mark.parametrize(("labels", "problem_type", "match"), [
    (torch.tensor([0, 3]), None, "labels contain 3, outside \\[0, num_labels=3\\)"),
    (torch.tensor([0, 1, 2]), None, "must have shape \\(2,\\) or \\(2, 1\\), got \\(3,\\)"),
    (torch.tensor([[0.5, 1.0, 0.0]]), None, "must have shape \\(2, 3\\)"),
    (torch.tensor([[0.5, 2.0, 0.0], [0.0, 0.0, 1.0]]), None, "lie in \\[0, 1\\]"),
    (torch.tensor([True, False]), None, "floating 0/1 targets, got torch.bool"),
    (torch.tensor([0.5, 1.0]), "single_label_classification", "integer class ids, got torch.float32"),
    (torch.tensor([1, 2]), "regression", "regression labels must be floating point"),
    (torch.tensor([1, 2]), "multi_label_classification", "floating 0/1 targets, got torch.int64"),
])
def test_bad_sequence_labels_raise(classifier, labels, problem_type, match) -> None:
    classifier.head.problem_type = problem_type
    try:
        with pytest.raises(ValueError, match=match):
            classifier(torch.randint(5, 50, (2, 4)), labels=labels)
    finally:
        classifier.head.problem_type = None


def test_bad_token_and_span_labels_raise() -> None:
    tagger = EncoderLM(EncoderLMConfig(**SMALL, head="token_classification", options={"head": {"num_labels": 2}}))
    ids = torch.randint(5, 50, (2, 4))
    with pytest.raises(ValueError, match="labels contain 2, outside"):
        tagger(ids, labels=torch.tensor([[0, 1, 2, -100], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="shape \\(2, 4\\), got \\(2, 3\\)"):
        tagger(ids, labels=torch.zeros(2, 3, dtype=torch.long))
    reader = EncoderLM(EncoderLMConfig(**SMALL, head="question_answering"))
    with pytest.raises(ValueError, match="start, end.*shape \\(2, 2\\)"):
        reader(ids, labels=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer \\(start, end\\) positions"):
        reader(ids, labels=torch.zeros(2, 2))
    embedder = EncoderLM(EncoderLMConfig(**SMALL, head="embedding"))
    with pytest.raises(ValueError, match="'embedding' head takes no labels"):
        embedder(ids, labels=torch.zeros(2, dtype=torch.long))


def test_decoder_batch_without_mask_or_pad_id_raises() -> None:
    model = DecoderLM(DecoderLMConfig(**SMALL, head="sequence_classification", pad_token_id=None)).eval()
    ids = torch.randint(5, 50, (2, 4))
    with pytest.raises(ValueError, match="2 rows, no attention_mask and pad_token_id=None"):
        model(ids)
    # With a mask, the last real token of each row is read whatever the padding side.
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    logits = model(ids, mask).logits
    alone = [model(ids[i:i + 1, mask[i]]).logits for i in range(2)]
    torch.testing.assert_close(logits, torch.cat(alone), atol=1e-5, rtol=0)


def test_every_head_is_registered() -> None:
    assert set(TASK_HEADS) | {"lm", "mlm"} <= set(blocks.names("head"))


def test_base_checkpoint_gets_a_new_head_with_a_warning(tmp_path) -> None:
    EncoderLM(EncoderLMConfig(**SMALL)).save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = EncoderLM.from_pretrained(tmp_path, head="sequence_classification", num_labels=3,
                                          head_options={"pre_classifier": "bert"})
    messages = " ".join(str(w.message) for w in caught)
    assert "newly initialized: ['head.classifier.bias', 'head.classifier.weight', 'head.dense.bias'" in messages
    assert "does not use the checkpoint's ['mlm_head." in messages
    assert model.config.head == "sequence_classification" and model.config.options["head"]["num_labels"] == 3
    assert model(torch.randint(5, 50, (2, 4))).logits.shape == (2, 3)
    with pytest.raises(ValueError, match="unknown head 'classify'"):
        EncoderLM.from_pretrained(tmp_path, head="classify")


@pytest.mark.parametrize("cls", [EncoderLM, DecoderLM])
def test_task_models_save_and_load_with_their_head(cls, tmp_path) -> None:
    config_class = EncoderLMConfig if cls is EncoderLM else DecoderLMConfig
    model = cls(config_class(**SMALL, head="token_classification",
                             options={"head": {"num_labels": 4, "id2label": dict(enumerate("abcd"))}})).eval()
    model.save_pretrained(tmp_path)
    again = cls.from_pretrained(tmp_path)
    assert again.config == model.config
    ids = torch.randint(5, 50, (2, 6))
    assert torch.equal(again(ids).logits, model(ids).logits)


def test_token_predictions_on_a_task_head_are_value_errors_naming_it() -> None:
    import models
    from serving import Engine

    decoder = models.DecoderLM.from_preset("tiny", head="sequence_classification",
                                           options={"head": {"num_labels": 3}}).eval()
    for call in (lambda: decoder.generate(torch.tensor([[5, 6]]), max_new_tokens=2), lambda: Engine(decoder)):
        with pytest.raises(ValueError, match="has the 'sequence_classification' head instead of its language-model"):
            call()
    encoder = models.EncoderLM.from_preset("tiny", head="token_classification", options={"head": {"num_labels": 3}})
    with pytest.raises(ValueError, match="fill_mask predicts tokens, but this model has the 'token_classification'"):
        encoder.eval().fill_mask(torch.tensor([[5, 4, 6]]))
