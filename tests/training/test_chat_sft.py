"""Chat SFT data: the supervised tokens are exactly the assistant's (against a hand-written reading of each published
template's turn format, and against transformers' ``return_assistant_tokens_mask`` — what TRL's
``assistant_only_loss`` uses — for a template with ``{% generation %}`` blocks), across packing boundaries (packed
logits and losses equal each conversation run alone); truncation keeps a target; bad files name their line."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from models import DecoderLM
from tests.strategies import conversations
from tests.tokenization.chat_templates import PUBLISHED
from tests.tokenization.test_chat import DOCUMENTS, SPECIALS
from tokenization import Tokenizer, train_byte_level_bpe
from training.chat_sft import ChatSFTCollator, ChatSFTDataset, tokenize_conversation
from training.collators import IGNORE_INDEX

# How each published template writes an assistant turn: (header, trims the content, footer, footer of the last
# message) — read off the templates by hand, independently of the prefix rule under test.
TURNS = {
    "smollm2": ("<|im_start|>assistant\n", False, "<|im_end|>\n", "<|im_end|>\n"),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", True, "<|eot_id|>", "<|eot_id|>"),
    "qwen3": ("<|im_start|>assistant\n", False, "<|im_end|>\n", "<|im_end|>\n"),
    "gemma2": ("<start_of_turn>model\n", True, "<end_of_turn>\n", "<end_of_turn>\n"),
    "mistral": (" [/INST]", False, "</s>", "</s>"),
    "phi3": ("<|assistant|>\n", False, "<|end|>\n", "<|end|>\n</s>"),
}
NO_SYSTEM = {"gemma2", "mistral"}


@pytest.fixture(scope="module")
def pair() -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    corpus = ["Hello there, the quick brown fox jumps over the lazy dog. Wie geht's? 2+2=4 你好 🙂"] * 4
    base = train_byte_level_bpe(corpus, vocab_size=320, min_frequency=1)
    base.backend.add_special_tokens(SPECIALS)
    ours = Tokenizer(base.backend, {"bos": "<s>", "eos": "</s>", "pad": "<|endoftext|>", "unk": None, "mask": None})
    theirs = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(base.to_str()),
                                     bos_token="<s>", eos_token="</s>", pad_token="<|endoftext|>")
    return ours, theirs


def expected_labels(tok: Tokenizer, name: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids and labels from the hand-written turn formats: the text after each assistant header through its footer."""
    header, trims, footer, last_footer = TURNS[name]
    text = tok.apply_chat_template(messages, chat_template=PUBLISHED[name], tokenize=False)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content = message["content"].strip() if trims else message["content"]
        turn = content + (last_footer if i == len(messages) - 1 else footer)
        at = text.index(header + turn, cursor) + len(header)
        spans.append((at, at + len(turn)))
        cursor = at + len(turn)
    enc = tok.backend.encode(text, add_special_tokens=False)
    labels = [i if any(lo <= s and e <= hi for lo, hi in spans) else IGNORE_INDEX
              for i, (s, e) in zip(enc.ids, enc.offsets, strict=True)]
    labels[0] = IGNORE_INDEX
    return enc.ids, labels


@pytest.mark.parametrize("name", list(TURNS))
@settings(max_examples=8)
@given(data=st.data())
def test_supervised_tokens_are_the_assistant_turns(pair, name: str, data) -> None:
    tok, _ = pair
    messages = data.draw(conversations(system=name not in NO_SYSTEM))
    got = tokenize_conversation(tok, messages, chat_template=PUBLISHED[name])
    ids, labels = expected_labels(tok, name, messages)
    assert got["input_ids"] == ids
    assert got["labels"] == labels
    assert any(label != IGNORE_INDEX for label in labels)


@settings(max_examples=10)
@given(messages=conversations())
def test_generation_blocks_give_transformers_assistant_mask(pair, messages) -> None:
    ours, theirs = pair
    got = tokenize_conversation(ours, messages, chat_template=DOCUMENTS)
    ref = theirs.apply_chat_template(messages, chat_template=DOCUMENTS, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert got["input_ids"] == ref["input_ids"]
    mask = [bool(m) for m in ref["assistant_masks"]]
    mask[0] = False
    assert [label != IGNORE_INDEX for label in got["labels"]] == mask
    assert all(label in (IGNORE_INDEX, i) for label, i in zip(got["labels"], got["input_ids"], strict=True))


def test_a_template_that_rewrites_earlier_turns_is_refused(pair) -> None:
    tok, _ = pair
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    with pytest.raises(ValueError, match=r"messages\[1\].*generation"):
        tokenize_conversation(tok, messages, chat_template=PUBLISHED["qwen3"])


@pytest.fixture(scope="module")
def tiny(pair) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM.from_preset("tiny", vocab_size=len(pair[0]), d_model=16, n_heads=2, d_ff=32, n_layers=1,
                                 dropout=0.0, pad_token_id=0).eval()


@settings(max_examples=3)
@given(chats=st.lists(conversations(max_turns=2), min_size=2, max_size=4), length=st.integers(40, 120))
def test_packing_keeps_each_conversation_as_if_alone(pair, tiny, chats, length) -> None:
    tok, _ = pair
    data = ChatSFTDataset([{"messages": m} for m in chats], tok, max_length=length,
                          chat_template=PUBLISHED["smollm2"])
    batch = ChatSFTCollator(tok.pad_token_id, max_length=length)(list(data))
    assert batch["input_ids"].shape[1] <= length
    with torch.no_grad():
        packed = tiny(batch["input_ids"], batch["attention_mask"], document_ids=batch["document_ids"]).logits
    seen, loss_packed, loss_alone = 0, 0.0, 0.0
    for r in range(batch["input_ids"].shape[0]):
        docs = batch["document_ids"][r]
        for d in range(int(docs.max()) + 1):
            where = (docs == d).nonzero().squeeze(1)
            item = data[seen]
            seen += 1
            assert batch["input_ids"][r, where].tolist() == item["input_ids"]
            assert batch["labels"][r, where].tolist() == item["labels"]  # supervised positions move with the doc
            with torch.no_grad():
                alone = tiny(torch.tensor([item["input_ids"]])).logits[0]
            torch.testing.assert_close(packed[r, where], alone, atol=1e-5, rtol=1e-5)
            labels = torch.tensor(item["labels"])
            loss_alone += torch.nn.functional.cross_entropy(alone[:-1], labels[1:], reduction="sum").item()
        shifted = torch.cat([batch["labels"][r, 1:], torch.tensor([IGNORE_INDEX])])
        loss_packed += torch.nn.functional.cross_entropy(packed[r], shifted, reduction="sum").item()
    assert seen == len(data)
    assert loss_packed == pytest.approx(loss_alone, rel=1e-5)


@settings(max_examples=10)
@given(length=st.integers(2, 60), prefix=st.integers(0, 40))
def test_truncation_never_leaves_a_row_without_a_target(pair, length, prefix) -> None:
    tok, _ = pair
    messages = [{"role": "system", "content": "the lazy dog " * prefix}, {"role": "user", "content": "fox?"},
                {"role": "assistant", "content": "jumps over"}, {"role": "user", "content": "again " * 10}]
    messages.append({"role": "assistant", "content": "the quick brown fox"})
    item = tokenize_conversation(tok, messages, max_length=length, chat_template=PUBLISHED["llama3"])
    assert len(item["input_ids"]) <= length
    assert item["labels"][0] == IGNORE_INDEX
    assert any(label != IGNORE_INDEX for label in item["labels"])
    full = tokenize_conversation(tok, messages, chat_template=PUBLISHED["llama3"])
    ids = full["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i:i + len(item["input_ids"])] == item["input_ids"])
    assert item["labels"][1:] == full["labels"][start + 1:start + len(item["labels"])]  # a window of the whole


BAD_LINES = [
    (b'{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}', "no 'role'"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}',
     "empty assistant turn"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "role 'wizard'"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8"),
    (b'{"messages": [', "not JSON"),
    (b'["a list"]', "expected a JSON object"),
    (b'{"conversation": []}', "no 'messages'"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_files_name_the_file_and_line(pair, tmp_path, line: bytes, message: str) -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path = tmp_path / "chat.jsonl"
    path.write_bytes(good.encode() + b"\n\n" + line + b"\n")
    with pytest.raises(ValueError, match=rf"chat\.jsonl, line 3: .*{message}"):
        ChatSFTDataset.from_jsonl(path, pair[0], chat_template=PUBLISHED["smollm2"])


def test_without_packing_each_conversation_is_a_padded_row(pair) -> None:
    tok, _ = pair
    chats = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "the fox"}],
             [{"role": "user", "content": "the quick brown fox jumps"}, {"role": "assistant", "content": "dog"}]]
    items = [tokenize_conversation(tok, m, chat_template=PUBLISHED["phi3"]) for m in chats]
    batch = ChatSFTCollator(tok.pad_token_id, pack=False)(items)
    assert "document_ids" not in batch and batch["input_ids"].shape[0] == 2
    for r, item in enumerate(items):
        n = len(item["input_ids"])
        assert batch["input_ids"][r, :n].tolist() == item["input_ids"]
        assert batch["labels"][r, :n].tolist() == item["labels"]
        assert (batch["labels"][r, n:] == IGNORE_INDEX).all() and not batch["attention_mask"][r, n:].any()
    with pytest.raises(ValueError, match="max_length"):
        ChatSFTCollator(tok.pad_token_id, pack=True)
    with pytest.raises(ValueError, match="same length"):
        ChatSFTCollator(tok.pad_token_id, max_length=8)([{"input_ids": [1, 2], "labels": [1]}])
