"""Tool-call parsers: a model's raw answer split into its text and the function calls it makes, one parser per
family format, registered by name (``zoo serve --tool-call-parser NAME``) and otherwise chosen from the chat
template.

- ``hermes`` — Hermes 2 Pro, Qwen 2.5 / 3, and others: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, the text around them is the content.
- ``llama3_json`` — Llama 3.1-3.3: ``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``),
  several separated by ``;``.
- ``mistral`` — ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) and
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+).
- ``pythonic`` — Llama 3.2 / 4 style ``[get_weather(city="Paris"), f()]`` (Python literals as arguments).
- ``json`` — the fallback: the whole answer is one ``{"name", "arguments" | "parameters"}`` object or a list of
  them, else a pythonic list.

A parser never raises on what it cannot read: the answer is then plain content with no calls.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as JSON text (as the OpenAI API sends them).

    Attributes:
        name: the function's name.
        arguments: its arguments, a JSON object as text.
        id: the call's id (``call_`` and 24 random hex digits by default).
    """

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call in OpenAI's ``tool_calls`` shape (with ``index`` for a streamed delta).

        Args:
            index: the call's position among the answer's calls, for a streamed delta (None: left out).

        Returns:
            ``{"id", "type": "function", "function": {"name", "arguments"}}`` (and ``index``).
        """
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


#: name -> parse(text) -> (content or None, calls)
PARSERS: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {}

#: The special tokens each parser reads (kept when the answer is decoded).
MARKERS: dict[str, tuple[str, ...]] = {}


def register(name: str, markers: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Register a parser ``fn(text) -> (content, calls)`` under ``name``.

    Args:
        name: the parser's name (``--tool-call-parser NAME``).
        markers: the special tokens it reads (kept when the answer is decoded).

    Returns:
        A decorator that registers the function and returns it unchanged.
    """
    def add(fn: Callable) -> Callable:
        PARSERS[name] = fn
        MARKERS[name] = markers
        return fn
    return add


def call_from(obj: Any) -> ToolCall | None:
    """A ``{"name", "arguments" | "parameters"}`` dict as a ``ToolCall`` (None for anything else).

    Args:
        obj: a parsed JSON value; its arguments may be a dict or a JSON object as text.

    Returns:
        The call, or None when ``obj`` is not a call object.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def calls_from_json(text: str) -> list[ToolCall] | None:
    """Calls from JSON text holding one call object or a list of them (None when it is not that).

    Args:
        text: JSON text.

    Returns:
        The calls, or None when ``text`` is not one call object or a non-empty list of them.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from(item) for item in items]
    return calls if calls and all(c is not None for c in calls) else None


@register("hermes", ("<tool_call>", "</tool_call>"))
def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """``<tool_call>{json}</tool_call>`` blocks (the last may be unclosed at the end of the answer).

    Args:
        text: the model's answer.

    Returns:
        ``(content, calls)``: the text around the calls (None when empty), and the calls; ``(text, [])`` when the
        answer does not hold calls in this format.
    """
    calls, spans = [], []
    for match in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL):
        parsed = calls_from_json(match.group(1))
        if parsed is None:
            return text, []
        calls += parsed
        spans.append(match.span())
    if not calls:
        return text, []
    content = "".join(text[start:end] for start, end in zip([0] + [e for _, e in spans], [s for s, _ in spans]
                                                             + [len(text)], strict=True)).strip()
    return content or None, calls


@register("llama3_json", ("<|python_tag|>",))
def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (after an optional ``<|python_tag|>``).

    Args:
        text: the model's answer.

    Returns:
        ``(content, calls)``: the text around the calls (None when empty), and the calls; ``(text, [])`` when the
        answer does not hold calls in this format.
    """
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = call_from(obj)
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return None, calls


@register("mistral", ("[TOOL_CALLS]", "[ARGS]"))
def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (repeated), after optional content.

    Args:
        text: the model's answer.

    Returns:
        ``(content, calls)``: the text around the calls (None when empty), and the calls; ``(text, [])`` when the
        answer does not hold calls in this format.
    """
    if "[TOOL_CALLS]" not in text:
        return text, []
    content, _, rest = text.partition("[TOOL_CALLS]")
    calls: list[ToolCall] = []
    if "[ARGS]" in rest:
        for part in rest.split("[TOOL_CALLS]"):
            name, _, args = part.partition("[ARGS]")
            call = call_from({"name": name.strip(), "arguments": args.strip()})
            if call is None:
                return text, []
            calls.append(call)
    else:
        parsed = calls_from_json(rest.strip())
        if parsed is None:
            return text, []
        calls = parsed
    return content.strip() or None, calls


@register("pythonic")
def parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    """``[f(a=1), g(b="x")]``: a Python list of calls with keyword arguments that are literals.

    Args:
        text: the model's answer.

    Returns:
        ``(content, calls)``: the text around the calls (None when empty), and the calls; ``(text, [])`` when the
        answer does not hold calls in this format.
    """
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return text, []
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            return text, []
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords}
        except (ValueError, TypeError, SyntaxError):
            return text, []
        if None in args:
            return text, []
        calls.append(ToolCall(item.func.id, json.dumps(args, ensure_ascii=False)))
    return (None, calls) if calls else (text, [])


@register("json")
def parse_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole answer as one call object or a list of them (``arguments`` or ``parameters``), else pythonic.

    Args:
        text: the model's answer.

    Returns:
        ``(content, calls)``: the text around the calls (None when empty), and the calls; ``(text, [])`` when the
        answer does not hold calls in this format.
    """
    calls = calls_from_json(text.strip())
    if calls:
        return None, calls
    return parse_pythonic(text)


def parser_for(template: str | None, name: str | None = None) -> str:
    """The parser's name: ``name`` itself, else the one whose markers the chat template writes, else ``json``.

    Args:
        template: the model's chat template, or None.
        name: the parser asked for (``--tool-call-parser``), or None to choose from the template.

    Returns:
        A key of ``PARSERS``.

    Raises:
        ValueError: an unknown ``name``.
    """
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"tool-call parser {name!r} is not one of {sorted(PARSERS)}")
        return name
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "json"


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """Split an answer into (content, calls) with the parser named ``parser``.

    Args:
        text: the model's answer.
        parser: a key of ``PARSERS``.

    Returns:
        ``(content, calls)`` as the parser returns them.
    """
    return PARSERS[parser](text)
