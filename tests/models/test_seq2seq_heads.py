"""Task heads on ``Seq2SeqTransformer``: BART's and T5's sequence-classification and QA classes against
``transformers`` (conversion, logits, losses of every problem type, export), and the heads it refuses."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers

import models
from models import Seq2SeqConfig, Seq2SeqTransformer
from models.convert import save_transformers

from .family_harness import build_hf

ATOL = 1e-4
VOCAB = 97
LENGTH = 11
#: family -> (config class, class stem, config fields): non-default sizes (T5: n_heads * d_kv != d_model).
FAMILIES = {
    "bart": ("BartConfig", "Bart", dict(
        vocab_size=VOCAB, d_model=48, encoder_layers=2, decoder_layers=1, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=72, decoder_ffn_dim=72, max_position_embeddings=40,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)),
    "t5": ("T5Config", "T5", dict(
        vocab_size=VOCAB, d_model=48, d_kv=10, d_ff=72, num_layers=2, num_decoder_layers=1, num_heads=4,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
}
TASKS = {"SequenceClassification": "sequence_classification", "QuestionAnswering": "question_answering"}


def build(family: str, task: str) -> torch.nn.Module:
    config_class, stem, fields = FAMILIES[family]
    labels = {} if task == "QuestionAnswering" else dict(num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    return build_hf(config_class, f"{stem}For{task}", **fields, **labels)


def batch(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch whose rows hold two EOS tokens each (the classifier reads the last), pads after."""
    fields = FAMILIES[family][2]
    eos, pad = fields["eos_token_id"], fields["pad_token_id"]
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, 8:] = 0
    ids[0, [4, LENGTH - 1]] = eos
    ids[1, [2, 7]] = eos
    return ids.masked_fill(~mask.bool(), pad), mask


def outputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, hf: bool, **labels) -> tuple:
    out = model(input_ids=ids, attention_mask=mask, **labels) if hf else model(ids, src_mask=mask.bool(), **labels)
    if getattr(out, "start_logits", None) is not None:
        return torch.stack([out.start_logits, out.end_logits], -1), out.loss
    return out.logits, out.loss


def compare(hf, other, ids, mask, task: str, other_is_hf: bool = False) -> None:
    expected, _ = outputs(hf, ids, mask, True)
    actual, _ = outputs(other, ids, mask, other_is_hf)
    assert expected.shape == actual.shape
    if task == "QuestionAnswering":  # per position: the real ones
        expected, actual = expected[mask.bool()], actual[mask.bool()]
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("task", list(TASKS))
@torch.no_grad()
def test_task_class_converts_computes_and_exports(family: str, task: str, tmp_path: Path) -> None:
    hf = build(family, task)
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf")
    assert isinstance(zoo, Seq2SeqTransformer) and zoo.config.head == TASKS[task]
    assert not hasattr(zoo, "lm_head")
    ids, mask = batch(family)
    compare(hf, zoo, ids, mask, task)

    # Losses: every problem type of the classifier; QA positions inside and outside the sequence.
    b = ids.shape[0]
    if task == "QuestionAnswering":
        for positions in (torch.tensor([[1, 4], [2, 3]]), torch.tensor([[LENGTH + 5, 2], [-3, LENGTH]])):
            expected = outputs(hf, ids, mask, True, start_positions=positions[:, 0], end_positions=positions[:, 1])
            torch.testing.assert_close(zoo(ids, src_mask=mask.bool(), labels=positions).loss, expected[1],
                                       atol=1e-5, rtol=1e-5)
    else:
        assert zoo.config.options["head"]["id2label"] == {"0": "neg", "1": "neu", "2": "pos"}
        gen = torch.Generator().manual_seed(2)
        for labels, problem_type in ((torch.tensor([2, 0]), None), (torch.rand(b, 3, generator=gen).round(), None),
                                     (torch.randn(b, 3, generator=gen), "regression")):
            hf.config.problem_type = zoo.head.problem_type = problem_type
            expected = outputs(hf, ids, mask, True, labels=labels)[1]
            torch.testing.assert_close(zoo(ids, src_mask=mask.bool(), labels=labels).loss, expected,
                                       atol=1e-5, rtol=1e-5)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_transformers(zoo, tmp_path / "export")  # the family it came from
        back = getattr(transformers, type(hf).__name__).from_pretrained(tmp_path / "export").float().eval()
    assert type(back).__name__ == type(hf).__name__
    compare(hf, back, ids, mask, task, other_is_hf=True)


def small(**fields) -> Seq2SeqConfig:
    return Seq2SeqConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                         max_len=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)


def test_heads_that_do_not_fit_raise() -> None:
    for head in ("token_classification", "embedding", "mlm"):
        with pytest.raises(ValueError, match=f"head '{head}' does not fit a Seq2SeqTransformer; expected one of"):
            small(head=head)
    with pytest.raises(ValueError, match="last EOS token \\(pooling 'last'\\), got pooling 'cls'"):
        small(head="sequence_classification", options={"head": {"pooling": "cls"}})
    with pytest.raises(ValueError, match="num_labels must be a positive integer, got 0"):
        small(head="sequence_classification", options={"head": {"num_labels": 0}})


def test_bad_inputs_to_a_task_head_raise() -> None:
    classifier = Seq2SeqTransformer(small(head="sequence_classification", options={"head": {"num_labels": 3}}))
    ids = torch.tensor([[5, 6, 2], [7, 8, 9]])
    with pytest.raises(ValueError, match=r"src_ids rows \[1\] contain no eos_token_id=2"):
        classifier(ids)
    with pytest.raises(ValueError, match="tgt_ids must have the shape of src_ids"):
        classifier(ids, torch.tensor([[1, 5], [1, 7]]))
    with pytest.raises(ValueError, match="labels contain 3, outside"):
        classifier(torch.tensor([[5, 2]]), labels=torch.tensor([3]))
    with pytest.raises(ValueError, match="decode predicts tokens, but this model has the 'sequence_classification'"):
        classifier.generate(ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="tgt_ids is None: the 'lm' head needs the decoder inputs"):
        Seq2SeqTransformer(small())(ids)
    no_eos = Seq2SeqTransformer(small(head="sequence_classification").replace(eos_token_id=None))
    with pytest.raises(ValueError, match="eos_token_id is None"):
        no_eos(ids)


def test_seq2seq_task_model_saves_and_loads_with_its_head(tmp_path: Path) -> None:
    model = Seq2SeqTransformer(small(head="question_answering")).eval()
    model.save_pretrained(tmp_path)
    again = Seq2SeqTransformer.from_pretrained(tmp_path)
    assert again.config == model.config
    ids = torch.tensor([[5, 6, 7, 2]])
    out = again(ids, torch.tensor([[1, 5, 6, 7]]))
    assert torch.equal(out.start_logits, model(ids, torch.tensor([[1, 5, 6, 7]])).start_logits)
    # tgt_ids left out: the source shifted right behind decoder_start_token_id.
    assert torch.equal(again(ids).logits, out.logits)
