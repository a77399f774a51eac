"""Task classes of every family against ``transformers``: conversion, logits, losses, export.

Generated over the families and the task classes ``transformers`` has for each (sequence classification, token
classification, question answering): a tiny random checkpoint at non-default sizes is saved by ``transformers``,
loaded with ``models.from_pretrained`` (which picks the head from ``architectures``), compared on padded batches
(both sides for decoders) and on the losses of each problem type, then exported and loaded back by ``transformers``
into the same class.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import blocks
import models
from models.convert import from_transformers, save_transformers
from models.convert.tasks import TASK_KIND

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
    # the MoE decoders (experts per token out of experts; transformers 5 fuses the experts in memory)
    "mixtral": ("MixtralConfig", "Mixtral", {**DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2Moe", {**DECODER, "moe_intermediate_size": 24, "num_experts": 4,
                                                 "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3Moe", {**DECODER, "head_dim": 16, "moe_intermediate_size": 24,
                                                 "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "gpt_oss": ("GptOssConfig", "GptOss", {**DECODER, "head_dim": 16, "num_local_experts": 4,
                                           "num_experts_per_tok": 2, "sliding_window": 8}),
    **{family: (f"{stem}Config", stem, {**DECODER, "moe_intermediate_size": 20, "n_routed_experts": 4,
                                        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
                                        "kv_lora_rank": 20, "q_lora_rank": None, "qk_rope_head_dim": 6,
                                        "qk_nope_head_dim": 10, "v_head_dim": 14, "n_group": 2, "topk_group": 1,
                                        "num_key_value_heads": 6})
       for family, stem in (("deepseek_v2", "DeepseekV2"), ("deepseek_v3", "DeepseekV3"))},
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
COVERED |= {(family, task) for family in ("mixtral", "qwen2_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")
            for task in TASKS} | {("qwen3_moe", "SequenceClassification"), ("qwen3_moe", "QuestionAnswering")}
#: the task classes the converters register (``models.convert.tasks``), by family: what the cases are made of.
REGISTERED = {family: [t.architecture for t in blocks.get(TASK_KIND, family).classes]
              for family in blocks.names(TASK_KIND)}
#: registered families whose task classes another file covers (encoder-decoders: tests/models/test_seq2seq_heads.py).
SEQ2SEQ = {"bart", "t5"}
CASES = [
    pytest.param(family, task, id=f"{stem}For{task}", marks=[pytest.mark.slow] if (family, task) in COVERED else [])
    for family, (_, stem, _) in FAMILIES.items() for task in TASKS if f"{stem}For{task}" in REGISTERED[family]
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


def test_the_cases_cover_every_registered_task_class() -> None:
    assert set(REGISTERED) - SEQ2SEQ <= set(FAMILIES), sorted(set(REGISTERED) - SEQ2SEQ - set(FAMILIES))
    covered = {f"{FAMILIES[family][1]}For{task}" for family, task in (case.values for case in CASES)}
    assert {name for family in set(REGISTERED) - SEQ2SEQ for name in REGISTERED[family]} == covered


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

    # No model_type: the export keeps the family the model came from (a RoBERTa is also BERT-shaped, a Mistral
    # without a window Llama-shaped), written as the same class with its names; reloaded as that class, every
    # weight is found (a re-initialised encoder would be off at every position).
    save_transformers(zoo, tmp_path / "export")
    _, stem, _ = FAMILIES[family]
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (exported["model_type"], exported["architectures"]) == (hf.config.model_type, [type(hf).__name__])
    back, info = getattr(transformers, f"{stem}For{task}").from_pretrained(tmp_path / "export",
                                                                           output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    back = back.float().eval()
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
