"""``classify`` / ``tag`` / ``answer`` / ``similarity`` against ``transformers``' pipelines on the same tiny models
(a WordPiece tokenizer, so that words split into subwords and punctuation). ``transformers`` 5 has no
question-answering pipeline: ``answer`` is checked against an enumeration of every span with that pipeline's rule, on
``transformers``' own tokenizer windows and logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import models

from .family_harness import build_hf

WORDS = ["the", "cat", "sat", "on", "mat", "john", "smith", "lives", "in", "paris", "new", "york", "who", "where",
         "does", "is", "a", "and", "of", "to"]
PIECES = ["##s", "##ing", "##ed", "##er", "##y", "##ton", "##ville"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ",", ".", "?", *WORDS, *PIECES, *LETTERS,
         *(f"##{c}" for c in LETTERS)]
BERT = dict(vocab_size=len(VOCAB), hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
            max_position_embeddings=64, pad_token_id=0)
TAGS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
TEXTS = ["john smith lives in paris.", "the cats sat on the mat, where johnston is", "newyorker smithville",
         "who lives in new york?", "a b c"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> transformers.PreTrainedTokenizerFast:
    folder = tmp_path_factory.mktemp("vocab")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return transformers.BertTokenizerFast(str(folder / "vocab.txt"))


def load(hf: torch.nn.Module, tokenizer, folder: Path, **options) -> torch.nn.Module:
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return models.from_pretrained(folder, **options)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5


@torch.no_grad()
def test_classify_matches_the_text_classification_pipeline(tokenizer, tmp_path) -> None:
    hf = build_hf("BertConfig", "BertForSequenceClassification", **BERT, num_labels=3,
                  id2label={0: "neg", 1: "neu", 2: "pos"}, scale=0.3)
    zoo = load(hf, tokenizer, tmp_path / "m")
    pipe = transformers.pipeline("text-classification", model=hf, tokenizer=tokenizer, device="cpu")
    for expected, actual in zip(pipe(TEXTS, top_k=None), zoo.classify(TEXTS, top_k=None), strict=True):
        assert [e["label"] for e in expected] == [a["label"] for a in actual]
        assert all(close(e["score"], a["score"]) for e, a in zip(expected, actual, strict=True))
    best = zoo.classify(TEXTS[0])
    assert best["label"] == pipe(TEXTS[0])[0]["label"] and close(best["score"], pipe(TEXTS[0])[0]["score"])
    # multi-label: sigmoid scores
    multi = models.from_pretrained(tmp_path / "m", head_options={"problem_type": "multi_label_classification"})
    hf.config.problem_type = "multi_label_classification"
    expected = pipe(TEXTS[1], top_k=None)
    actual = multi.classify(TEXTS[1], top_k=None)
    assert [e["label"] for e in expected] == [a["label"] for a in actual]
    assert all(close(e["score"], a["score"]) for e, a in zip(expected, actual, strict=True))
    zoo.tokenizer = None
    with pytest.raises(ValueError, match="classify needs a tokenizer"):
        zoo.classify("the cat")
    with pytest.raises(ValueError, match="classify needs a 'sequence_classification' head"):
        models.EncoderLM(models.EncoderLMConfig()).classify("x")


@pytest.mark.parametrize("aggregation", ["first", "average", "max"])
@torch.no_grad()
def test_tag_matches_the_token_classification_pipeline(tokenizer, tmp_path, aggregation) -> None:
    hf = build_hf("BertConfig", "BertForTokenClassification", **BERT, num_labels=5, id2label=TAGS, scale=0.5)
    zoo = load(hf, tokenizer, tmp_path / "m")
    pipe = transformers.pipeline("token-classification", model=hf, tokenizer=tokenizer, device="cpu",
                                 aggregation_strategy=aggregation)
    found = 0
    for text in TEXTS:
        expected, actual = pipe(text), zoo.tag(text, aggregation=aggregation)
        assert [(e["entity_group"], e["word"], e["start"], e["end"]) for e in expected] == \
            [(a["entity_group"], a["word"], a["start"], a["end"]) for a in actual]
        assert all(close(float(e["score"]), a["score"]) for e, a in zip(expected, actual, strict=True))
        found += len(actual)
    assert found > 3  # the random tagger finds entities: the comparison is not vacuous
    with pytest.raises(ValueError, match="unknown aggregation 'simple'"):
        zoo.tag("x", aggregation="simple")


def reference_answer(hf, tokenizer, question: str, context: str, max_answer_len: int, max_seq_len: int = 384,
                     stride: int = 128) -> dict:
    """transformers 4's question-answering pipeline rule by enumeration: per window, softmax over the context
    tokens and [CLS] ([CLS] then zeroed), the best span start <= end < start + max_answer_len in the context, widened
    to whole words; the best window wins."""
    enc = tokenizer(question, context, truncation="only_second", max_length=max_seq_len, stride=stride,
                    return_overflowing_tokens=True, return_offsets_mapping=True, return_token_type_ids=True)
    best = None
    for window in range(len(enc["input_ids"])):
        ids = torch.tensor([enc["input_ids"][window]])
        out = hf(input_ids=ids, token_type_ids=torch.tensor([enc["token_type_ids"][window]]))
        sequence = enc.sequence_ids(window)
        context_tokens = [i for i, s in enumerate(sequence) if s == 1]
        keep = torch.tensor([i in context_tokens or ids[0, i] == tokenizer.cls_token_id for i in range(ids.shape[1])])
        start_p, end_p = (torch.where(keep, logits[0], -10000.0).softmax(-1) for logits in (out.start_logits,
                                                                                            out.end_logits))
        words = enc.word_ids(window)
        for s in context_tokens:
            for e in context_tokens:
                if s <= e < s + max_answer_len:
                    score = float(start_p[s] * end_p[e])
                    if best is None or score > best[0]:
                        offsets = enc["offset_mapping"][window]
                        first = min(offsets[i][0] for i in context_tokens if words[i] == words[s])
                        last = max(offsets[i][1] for i in context_tokens if words[i] == words[e])
                        best = (score, first, last)
    score, start, end = best
    return {"score": score, "start": start, "end": end, "answer": context[start:end]}


@torch.no_grad()
def test_answer_matches_the_question_answering_rule(tokenizer, tmp_path) -> None:
    hf = build_hf("BertConfig", "BertForQuestionAnswering", **BERT, scale=0.5)
    zoo = load(hf, tokenizer, tmp_path / "m")
    context = "john smith lives in paris and the cat sat on the mat of newyorker smithville."
    for question in ["who lives in paris?", "where does the cat sit?"]:
        expected = reference_answer(hf, tokenizer, question, context, max_answer_len=5)
        actual = zoo.answer(question, context, max_answer_len=5)
        assert (expected["start"], expected["end"], expected["answer"]) == \
            (actual["start"], actual["end"], actual["answer"])
        assert close(expected["score"], actual["score"])
    # A context longer than one window: windows of 24 tokens overlapping by 8.
    long = " ".join([context] * 3)
    expected = reference_answer(hf, tokenizer, "who is john?", long, max_answer_len=4, max_seq_len=24, stride=8)
    actual = zoo.answer("who is john?", long, max_seq_len=24, stride=8, max_answer_len=4)
    assert (expected["start"], expected["end"], expected["answer"]) == (actual["start"], actual["end"],
                                                                          actual["answer"])
    assert close(expected["score"], actual["score"])
    assert len(tokenizer("who is john?", long)["input_ids"]) > 24  # several windows really ran


@torch.no_grad()
def test_similarity_is_the_cosine_of_the_embeddings(tokenizer, tmp_path) -> None:
    hf = build_hf("BertConfig", "BertModel", **BERT)
    zoo = load(hf, tokenizer, tmp_path / "m", head="embedding", head_options={"pooling": "mean"})
    a, b = TEXTS[:2], TEXTS[2:]
    sims = zoo.similarity(a, b)
    left, right = zoo.embed(a), zoo.embed(b)
    brute = torch.tensor([[float(torch.cosine_similarity(x, y, dim=0)) for y in right] for x in left])
    torch.testing.assert_close(sims, brute, atol=1e-6, rtol=0)
