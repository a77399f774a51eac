"""Where the assistant speaks in a rendered conversation: the character spans a chat SFT loss is taken on.

Two rules, the ones ``transformers`` and TRL use for ``assistant_only_loss``:

- a template with ``{% generation %}`` blocks marks the assistant's text itself: the spans are exactly what those
  blocks render (``transformers``' ``return_assistant_tokens_mask``);
- otherwise each assistant turn is found by rendering prefixes: the turn starts where the conversation before it,
  rendered with the generation prompt, ends, and it runs as far as the conversation up to and including the turn
  agrees with the whole rendering (its content and the end-of-turn text the template writes after it).

The prefix rule needs a template that renders earlier turns the same whatever follows them; one that does not (e.g.
showing reasoning only after the last user query) is refused with a ``ValueError`` that names the turn — give such a
template ``{% generation %}`` blocks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .chat import GENERATION_MARKS, render_chat

# Private-use code points: no published template or tokenizer writes them.
_START, _END = "\ue000", "\ue001"


def has_generation_blocks(template: str) -> bool:
    """Whether ``template`` marks the assistant's text with ``{% generation %}`` blocks.

    Args:
        template: the Jinja chat template's text.

    Returns:
        True when it holds both ``generation`` and ``endgeneration``.
    """
    return "generation" in template and "endgeneration" in template


def assistant_spans(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **context: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and find the characters the assistant writes.

    Args:
        template: the Jinja chat template.
        messages: the conversation (``[{"role", "content"}, ...]``).
        tools: JSON schemas of tools, for templates that use them.
        context: further names for the template (the special tokens …).

    Returns:
        ``(text, spans)``: the rendered conversation (as ``render_chat`` renders it) and sorted, disjoint
        ``(start, end)`` character ranges of the assistant's text in it.

    Raises:
        ValueError: as ``render_chat``; text holding the marker code points U+E000/U+E001; with the prefix rule,
            an assistant turn first in the conversation, or one the template renders differently when later turns
            follow.
    """
    if has_generation_blocks(template):
        return _generation_spans(template, messages, tools, context)
    text = render_chat(template, messages, tools=tools, **context)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if i == 0:
            raise ValueError("messages[0] is an assistant turn; the prefix rule needs a system or user message "
                             "before it (or a template with {% generation %} blocks)")
        prompt = render_chat(template, messages[:i], add_generation_prompt=True, tools=tools, **context)
        turn = render_chat(template, messages[: i + 1], tools=tools, **context)
        if not text.startswith(prompt) or not turn.startswith(prompt):
            raise ValueError(f"the chat template renders the conversation before messages[{i}] (the assistant's "
                             "turn) differently from its start in the whole conversation; the assistant's tokens "
                             "cannot be found by rendering prefixes: use a template with {% generation %} blocks")
        end = len(prompt) + common_prefix_length(turn[len(prompt):], text[len(prompt):])
        if end == len(prompt):
            raise ValueError(f"the chat template renders messages[{i}] (the assistant's turn) differently when "
                             "later messages follow; the assistant's tokens cannot be found by rendering prefixes: "
                             "use a template with {% generation %} blocks")
        spans.append((len(prompt), end))
    return text, spans


def _generation_spans(template: str, messages: Sequence[Mapping[str, Any]], tools: Any,
                      context: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
    token = GENERATION_MARKS.set((_START, _END))
    try:
        marked = render_chat(template, messages, tools=tools, **context)
    finally:
        GENERATION_MARKS.reset(token)
    if marked.count(_START) != marked.count(_END) or _has_marks(messages, tools, context):
        raise ValueError("the conversation holds the private-use characters U+E000/U+E001, which mark the "
                         "assistant's text while rendering; remove them")
    text, spans, depth, start = [], [], 0, 0
    length = 0
    for piece in _split_marks(marked):
        if piece == _START:
            if depth == 0:
                start = length
            depth += 1
        elif piece == _END:
            depth -= 1
            if depth == 0 and length > start:
                spans.append((start, length))
        else:
            text.append(piece)
            length += len(piece)
    return "".join(text), spans


def _split_marks(marked: str) -> list[str]:
    return [p for p in re.split(f"([{_START}{_END}])", marked) if p]


def _has_marks(*values: Any) -> bool:
    return any(_START in s or _END in s for s in _strings(values))


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters, token ids) ``a`` and ``b`` share.

    Args:
        a: the first sequence.
        b: the second sequence.

    Returns:
        The length of their common prefix.
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
