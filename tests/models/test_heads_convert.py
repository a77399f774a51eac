"""Task classes of every family against ``transformers``: conversion, logits, losses, export.

Generated over the families and the task classes ``transformers`` has for each (sequence classification, token
classification, question answering): a tiny random checkpoint at non-default sizes is saved by ``transformers``,
loaded with ``models.from_pretrained`` (which picks the head from ``architectures``), compared on padded batches
(both sides for decoders) and on the losses of each problem type, then exported and loaded back by ``transformers``
into the same class.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import models
from models.convert import from_transformers, save_transformers

from .family_harness import build_hf, left_padded, right_padded

ATOL = 1e-4
VOCAB = 97
DECODER = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
#: family -> (config class, class stem, config fields).
FAMILIES = {
    "bert": ("BertConfig", "Bert", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                        num_attention_heads=6, max_position_embeddings=40, pad_token_id=0)),
    "roberta": ("RobertaConfig", "Roberta", dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72,
                                                 num_hidden_layers=2, num_attention_heads=6, max_position_embeddings=40,
                                                 pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)),
    "distilbert": ("DistilBertConfig", "DistilBert", dict(vocab_size=VOCAB, dim=48, hidden_dim=72, n_layers=2,
                                                          n_heads=6, max_position_embeddings=32, pad_token_id=0)),
    "modernbert": ("ModernBertConfig", "ModernBert", dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=64, local_attention=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, classifier_pooling="mean", classifier_activation="silu")),
    "llama": ("LlamaConfig", "Llama", DECODER),
    "mistral": ("MistralConfig", "Mistral", DECODER),
    "qwen2": ("Qwen2Config", "Qwen2", DECODER),
    "qwen3": ("Qwen3Config", "Qwen3", {**DECODER, "head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2", {**DECODER, "head_dim": 16, "query_pre_attn_scalar": 20,
                                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "phi3": ("Phi3Config", "Phi3", DECODER),
    "gpt2": ("GPT2Config", "GPT2", dict(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=64,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoX", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                                  eos_token_id=2)),
}
TASKS = {"SequenceClassification": "sequence_classification", "TokenClassification": "token_classification",
         "QuestionAnswering": "question_answering"}
ENCODERS = ("bert", "roberta", "distilbert", "modernbert")
DECODER_STEMS = tuple(stem for family, (_, stem, _) in FAMILIES.items() if family not in ENCODERS)
#: decoder classes whose head and names another fast case covers (Llama's token classification and QA, GPT-2's
#: classifier names, each family's sequence classification for its prefix): slow, to keep the suite short.
COVERED = {("mistral", "TokenClassification"), ("mistral", "QuestionAnswering"), ("qwen2", "TokenClassification"),
           ("qwen2", "QuestionAnswering"), ("qwen3", "TokenClassification"), ("gemma2", "TokenClassification"),
           ("phi3", "TokenClassification"), ("gpt_neox", "TokenClassification"), ("gpt_neox", "QuestionAnswering")}
CASES = [
    pytest.param(family, task, id=f"{stem}For{task}", marks=[pytest.mark.slow] if (family, task) in COVERED else [])
    for family, (_, stem, _) in FAMILIES.items() for task in TASKS if hasattr(transformers, f"{stem}For{task}")
]
LENGTH = 11


def build(family: str, task: str) -> torch.nn.Module:
    config_class, stem, fields = FAMILIES[family]
    labels = {} if task == "QuestionAnswering" else dict(num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    return build_hf(config_class, f"{stem}For{task}", **fields, **labels)


def batches(family: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A right-padded batch, and a left-padded one for decoders; padding holds the pad id (which transformers'
    decoders look for), real tokens never do."""
    low, pad = 3, FAMILIES[family][2]["pad_token_id"]
    ids, mask = right_padded(VOCAB, LENGTH, low=low)
    out = [(ids, mask)]
    if family not in ENCODERS:
        left_ids, left_mask = left_padded(VOCAB - low, LENGTH)
        out.append((left_ids + low, left_mask))
    return [(ids.masked_fill(~mask.bool(), pad), mask) for ids, mask in out]


def outputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, hf: bool, **labels) -> tuple:
    if hf:
        # transformers counts positions from the first column unless told; the zoo from the first real token.
        decoder = type(model).__name__.startswith(DECODER_STEMS)
        extra = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if decoder else {}
        out = model(input_ids=ids, attention_mask=mask, **extra, **labels)
    else:
        out = model(ids, mask, **labels)
    if hasattr(out, "start_logits") and out.start_logits is not None:
        return torch.stack([out.start_logits, out.end_logits], -1), out.loss
    return out.logits, out.loss


def compare(hf, zoo, ids, mask, task: str, zoo_is_hf: bool = False) -> None:
    expected, _ = outputs(hf, ids, mask, True)
    actual, _ = outputs(zoo, ids, mask, zoo_is_hf)
    assert expected.shape == actual.shape
    if task != "SequenceClassification":  # per token: the real positions
        expected, actual = expected[mask.bool()], actual[mask.bool()]
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("family", "task"), CASES)
@torch.no_grad()
def test_task_class_converts_computes_and_exports(family: str, task: str, tmp_path: Path) -> None:
    hf = build(family, task)
    hf.save_pretrained(tmp_path / "hf")
    zoo = models.from_pretrained(tmp_path / "hf")
    assert isinstance(zoo, models.EncoderLM if family in ENCODERS else models.DecoderLM)
    assert zoo.config.head == TASKS[task]
    if task != "QuestionAnswering":
        assert zoo.config.options["head"]["id2label"] == {"0": "neg", "1": "neu", "2": "pos"}
    for ids, mask in batches(family):
        compare(hf, zoo, ids, mask, task)

    save_transformers(zoo, tmp_path / "export", model_type=family)
    _, stem, _ = FAMILIES[family]
    back = getattr(transformers, f"{stem}For{task}").from_pretrained(tmp_path / "export").float().eval()
    assert type(back).__name__ == type(hf).__name__
    compare(hf, back, *batches(family)[-1], task, zoo_is_hf=True)


@pytest.mark.parametrize("family", ["bert", "llama"])
@pytest.mark.parametrize("task", list(TASKS))
@torch.no_grad()
def test_losses_match_transformers(family: str, task: str) -> None:
    """Every problem type of each head (the losses live in the heads, the same for every family; an encoder and a
    decoder cover the two poolings)."""
    hf = build(family, task)
    converted = from_transformers({**hf.config.to_dict(), "architectures": [type(hf).__name__]}, hf.state_dict())
    zoo = converted.architecture(converted.config).eval()
    zoo.load_state_dict(converted.state_dict)
    ids, mask = batches(family)[-1]
    b = ids.shape[0]
    if task == "QuestionAnswering":
        # Out-of-range positions: clamped to [0, L], and L (past the sequence) ignored. The softmax runs over every
        # position, padding included, whose states the zoo computes from other positions: unpadded rows here.
        ids, mask = ids.masked_fill(~mask.bool(), 5), torch.ones_like(mask)
        cases = [torch.tensor([[1, 4], [2, 3]]), torch.tensor([[LENGTH + 5, 2], [-3, LENGTH]])]
        for positions in cases:
            expected = outputs(hf, ids, mask, True, start_positions=positions[:, 0],
                               end_positions=positions[:, 1])[1]
            torch.testing.assert_close(zoo(ids, mask, labels=positions).loss, expected, atol=1e-5, rtol=1e-5)
        return
    if task == "TokenClassification":
        labels = torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(1))
        labels[~mask.bool()] = -100
        cases = [(labels, None)]
    else:
        gen = torch.Generator().manual_seed(2)
        cases = [(torch.tensor([2, 0][:b]), None), (torch.rand(b, 3, generator=gen).round(), None),
                 (torch.randn(b, 3, generator=gen), "regression")]
    for labels, problem_type in cases:
        hf.config.problem_type = problem_type  # transformers stores the type it inferred at the previous call
        if hasattr(zoo.head, "problem_type"):
            zoo.head.problem_type = problem_type
        expected = outputs(hf, ids, mask, True, labels=labels)[1]
        torch.testing.assert_close(zoo(ids, mask, labels=labels).loss, expected, atol=1e-5, rtol=1e-5)
    if hasattr(zoo.head, "problem_type"):
        zoo.head.problem_type = None
