"""Chat SFT: conversations rendered with the model's chat template, the loss on the assistant's tokens only, packed.

``ChatSFTDataset`` renders each conversation once (``tokenization.chat_spans``: ``{% generation %}`` blocks where
the template has them, else rendered prefixes — TRL's ``assistant_only_loss`` rule) and keeps ``input_ids`` with
``labels`` equal to the ids on the assistant's tokens and -100 elsewhere. ``ChatSFTCollator`` packs whole
conversations into rows of ``max_length`` tokens (first fit, in order; a conversation never straddles two rows) with
``document_ids``, so attention stays inside each conversation and positions restart at each (``DecoderLM``).

Truncation keeps the start of a conversation longer than ``max_length``; where that would leave no supervised token
it keeps instead the ``max_length`` tokens that end with the first assistant turn, so no row is without a target.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from tokenization import Tokenizer
from tokenization.chat_spans import assistant_spans, has_generation_blocks

from .collators import IGNORE_INDEX, pad_rows
from .jsonl import read_conversations


def tokenize_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    max_length: int | None = None,
    chat_template: str | None = None,
) -> dict[str, list[int]]:
    """One conversation as ids and labels (the ids on the assistant's tokens, -100 elsewhere).

    A token is the assistant's when it lies inside the assistant's text (``assistant_spans``), or with
    ``{% generation %}`` blocks when it overlaps it.

    Args:
        tokenizer: the model's tokenizer (with a chat template, or pass ``chat_template``).
        messages: the conversation.
        tools: JSON schemas of tools.
        max_length: truncate to this many tokens (>= 2; see the module docstring).
        chat_template: a template to use instead of the tokenizer's.

    Returns:
        ``{"input_ids": [...], "labels": [...]}``, of equal length.

    Raises:
        ValueError: no chat template, a bad ``max_length``, as ``assistant_spans``, or no assistant token.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        raise ValueError("the tokenizer has no chat template; chat SFT renders conversations with one")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"max_length must be an integer >= 2 or None, got {max_length!r}")
    names = {f"{role}_token": token for role, token in tokenizer.special_tokens.items() if token is not None}
    text, spans = assistant_spans(template, messages, tools=tools, **names)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    ids, offsets = list(encoding.ids), list(encoding.offsets)
    labels = [IGNORE_INDEX] * len(ids)
    # {% generation %} spans are exact: a token overlapping one is the assistant's (as transformers marks it). A
    # prefix-rule span ends where two renderings stop agreeing, which may be inside the next turn's first token
    # (``<|end|>\n</s>`` against ``<|end|>\n<|user|>``): there only tokens wholly inside count.
    overlap = has_generation_blocks(template)
    span = 0
    for t, (start, end) in enumerate(offsets):
        while span < len(spans) and spans[span][1] <= start:
            span += 1
        if span < len(spans):
            lo, hi = spans[span]
            if (start < hi and end > lo) if overlap else (lo <= start and end <= hi):
                labels[t] = ids[t]
    if max_length is not None and len(ids) > max_length:
        ids, labels = _truncate(ids, labels, max_length)
    labels[0] = IGNORE_INDEX  # nothing in its own document precedes the first token
    if all(label == IGNORE_INDEX for label in labels):
        raise ValueError("the rendered conversation has no assistant token to learn from")
    return {"input_ids": ids, "labels": labels}


def _truncate(ids: list[int], labels: list[int], max_length: int) -> tuple[list[int], list[int]]:
    if any(label != IGNORE_INDEX for label in labels[1:max_length]):
        return ids[:max_length], labels[:max_length]
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    end = first
    while end < len(labels) and labels[end] != IGNORE_INDEX:
        end += 1
    start = max(0, end - max_length)
    return ids[start:start + max_length], labels[start:start + max_length]


class ChatSFTDataset(Sequence):
    """Tokenized conversations for chat SFT (each item ``{"input_ids", "labels"}``, see ``tokenize_conversation``).

    Args:
        conversations: ``{"messages": [...], "tools": [...]?}`` dicts (``training.jsonl.read_conversations``).
        tokenizer: the model's tokenizer.
        max_length: truncate each conversation to this many tokens.
        chat_template: a template to use instead of the tokenizer's.

    Raises:
        ValueError: as ``tokenize_conversation``, naming the conversation (and the file line with ``from_jsonl``).
    """

    def __init__(self, conversations: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, *,
                 max_length: int | None = None, chat_template: str | None = None,
                 where: Sequence[str] | None = None) -> None:
        self.items = []
        for i, conversation in enumerate(conversations):
            try:
                self.items.append(tokenize_conversation(tokenizer, conversation["messages"],
                                                        tools=conversation.get("tools"), max_length=max_length,
                                                        chat_template=chat_template))
            except ValueError as err:
                raise ValueError(f"{where[i] if where else f'conversation {i}'}: {err}") from None
        if not self.items:
            raise ValueError("no conversations to train on")

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], tokenizer: Tokenizer, **options: Any) -> ChatSFTDataset:
        """Read and tokenize a JSON Lines file of conversations (``training.jsonl.read_conversations``).

        Args:
            path: the JSON Lines file.
            tokenizer: the model's tokenizer.
            **options: ``max_length`` and ``chat_template``, as the class takes them.

        Returns:
            The dataset, one item per conversation.

        Raises:
            ValueError: naming the file and line.
        """
        conversations = read_conversations(path)
        return cls(conversations, tokenizer, where=[f"{path}, conversation {i + 1}" for i in
                                                    range(len(conversations))], **options)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:  # type: ignore[override]
        return self.items[index]

    @property
    def supervised_tokens(self) -> int:
        """How many tokens carry a label in all."""
        return sum(sum(label != IGNORE_INDEX for label in item["labels"]) for item in self.items)


class ChatSFTCollator:
    """Batches of tokenized conversations: packed rows with ``document_ids`` (``pack=True``), or one padded row each.

    Args:
        pad_token_id: the padding id.
        max_length: the row length with packing (conversations longer are cut, as ``tokenize_conversation`` cuts).
        pack: pack whole conversations into rows.

    Raises:
        ValueError: a negative pad id, or ``pack`` without ``max_length``.
    """

    def __init__(self, pad_token_id: int, *, max_length: int | None = None, pack: bool = True) -> None:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative integer, got {pad_token_id!r}")
        if pack and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
            raise ValueError(f"pack=True needs max_length, an integer >= 2 (the row length), got {max_length!r}")
        self.pad_token_id, self.max_length, self.pack = pad_token_id, max_length, bool(pack)

    def __call__(self, examples: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, Tensor]:
        """Batch ``examples`` (``{"input_ids", "labels"}`` dicts).

        Returns:
            ``input_ids``, ``labels`` ``(B, L)`` long, ``attention_mask`` ``(B, L)`` bool and, with packing,
            ``document_ids`` ``(B, L)`` long (-1 on padding); labels are -100 on padding and on the first token of
            every conversation.

        Raises:
            ValueError: an empty batch or an example without ``input_ids`` and ``labels`` of one length.
        """
        if not examples:
            raise ValueError("cannot collate an empty batch")
        docs = []
        for i, example in enumerate(examples):
            ids, labels = list(example.get("input_ids", ())), list(example.get("labels", ()))
            if not ids or len(ids) != len(labels):
                raise ValueError(f"example {i} needs non-empty 'input_ids' and 'labels' of the same length")
            if self.max_length is not None and len(ids) > self.max_length:
                ids, labels = _truncate(ids, labels, self.max_length)
            docs.append((ids, labels))
        if not self.pack:
            input_ids, attention_mask = pad_rows([d[0] for d in docs], self.pad_token_id)
            labels, _ = pad_rows([[IGNORE_INDEX, *d[1][1:]] for d in docs], IGNORE_INDEX)
            return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        rows: list[list[tuple[list[int], list[int]]]] = []
        for doc in docs:  # first fit, in order
            for row in rows:
                if sum(len(d[0]) for d in row) + len(doc[0]) <= self.max_length:  # type: ignore[operator]
                    row.append(doc)
                    break
            else:
                rows.append([doc])
        id_rows = [[t for d in row for t in d[0]] for row in rows]
        label_rows = [[t for d in row for t in [IGNORE_INDEX, *d[1][1:]]] for row in rows]
        doc_rows = [[j for j, d in enumerate(row) for _ in d[0]] for row in rows]
        input_ids, attention_mask = pad_rows(id_rows, self.pad_token_id)
        labels, _ = pad_rows(label_rows, IGNORE_INDEX)
        document_ids, _ = pad_rows(doc_rows, -1)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "document_ids": document_ids}
