"""The server's structured outputs and tool calls: OpenAI's ``response_format`` and vLLM's ``structured_outputs``
as a decoding ``Constraint``; ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as the template's tools, a
constraint (``required`` and a named function) and the parser that reads the answer back into ``tool_calls``.

- ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}`` (the schema is enforced whatever ``strict`` says).
- ``structured_outputs`` (vLLM's extension, one key of): ``{"json": schema}``, ``{"json_object": true}``,
  ``{"regex": pattern}``, ``{"grammar": lark_or_gbnf}``, ``{"choice": [strings]}``.
- ``tool_choice``: ``"none"`` (tools rendered, the answer is content), ``"auto"`` (the answer is parsed by the
  family's parser, ``serving.tool_parsers``), ``"required"`` (the answer is constrained to a JSON list of
  ``{"name", "arguments"}`` calls, one at most when ``parallel_tool_calls`` is false) and a named function (the
  answer is constrained to that function's arguments schema).

Errors are ``APIError`` 400s naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from models.generation.constraints import Constraint

from .protocol import APIError
from .tool_parsers import MARKERS, ToolCall, calls_from_json, parse_tool_calls

#: ``structured_outputs`` keys and the constraint each builds.
STRUCTURED_KEYS = {"json": Constraint.json_schema, "regex": Constraint.regex, "grammar": Constraint.grammar,
                   "choice": Constraint.choice, "json_object": lambda value: Constraint.json_object()}


def checked(build: Any, value: Any, param: str) -> Constraint:
    """``build(value)`` validated; a bad one is a 400 naming ``param``.

    Args:
        build: a ``Constraint`` constructor (``Constraint.json_schema``, ``Constraint.regex`` …).
        value: what it builds from (a schema, a pattern, a grammar, choices).
        param: the request field ``value`` came from.

    Returns:
        The checked constraint.

    Raises:
        APIError: 400 when the constraint is invalid (``invalid_schema``) or its extra is not installed
            (``unsupported``).
    """
    try:
        constraint = build(value)
        constraint.check()
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param=param, code="invalid_schema") from None
    except ImportError as err:  # the structured extra is not installed
        raise APIError(400, f"{param}: {err}", param=param, code="unsupported") from None
    return constraint


def response_constraint(response_format: Any, structured_outputs: Any) -> Constraint | None:
    """The constraint a request's ``response_format`` or ``structured_outputs`` asks for (None: free text).

    Args:
        response_format: OpenAI's ``response_format`` field, or None.
        structured_outputs: vLLM's ``structured_outputs`` field, or None.

    Returns:
        The constraint, or None for free text.

    Raises:
        APIError: 400 for an unknown type, a missing or invalid schema, pattern or grammar, or both fields.
    """
    found = None
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            found = Constraint.json_object()
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "response_format.json_schema.schema: expected a JSON schema object",
                               param="response_format.json_schema.schema", code="invalid_schema")
            found = checked(Constraint.json_schema, spec["schema"], "response_format.json_schema.schema")
        elif kind != "text":
            raise APIError(400, f"response_format.type={kind!r}: expected 'text', 'json_object' or 'json_schema'",
                           param="response_format.type")
    if structured_outputs is not None:
        keys = [k for k, v in structured_outputs.items() if v is not None and v is not False] \
            if isinstance(structured_outputs, dict) else []
        if len(keys) != 1 or keys[0] not in STRUCTURED_KEYS:
            raise APIError(400, f"structured_outputs: expected exactly one of {sorted(STRUCTURED_KEYS)}, got "
                                f"{keys if isinstance(structured_outputs, dict) else structured_outputs!r}",
                           param="structured_outputs")
        if found is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        key = keys[0]
        found = checked(STRUCTURED_KEYS[key], structured_outputs[key], f"structured_outputs.{key}")
    return found


@dataclasses.dataclass
class ToolPlan:
    """How a chat request with ``tools`` is answered.

    Attributes:
        tools: the tools as the template renders them.
        choice: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
        name: the named function (``"named"``), else None.
        parallel: whether the answer may hold several calls.
        parser: the tool-call parser's name (``serving.tool_parsers``).
        constraint: the decoding constraint (``"required"`` and ``"named"``), else None.
    """

    tools: list[dict[str, Any]]  # as the template renders them
    choice: str  # "none", "auto", "required" or "named"
    name: str | None  # the named function
    parallel: bool
    parser: str
    constraint: Constraint | None

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer as (content, tool calls).

        Args:
            text: the model's answer.

        Returns:
            ``(content, calls)``: content None when the answer is only calls.
        """
        if self.choice == "named":
            return None, [ToolCall(self.name, text.strip())]
        if self.choice == "required":
            calls = calls_from_json(text.strip())
            return (text, []) if calls is None else (None, calls)
        if self.choice == "none":
            return text, []
        content, calls = parse_tool_calls(text, self.parser)
        return content, calls if self.parallel else calls[:1]


def check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    """The functions of ``tools`` by name, each with its parameters schema checked.

    Args:
        tools: the request's ``tools`` field.

    Returns:
        Function name -> its parameters schema (an empty object schema when it has none).

    Raises:
        APIError: 400 naming ``tools[i]``.
    """
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools: expected a non-empty list of {'type': 'function', 'function': {...}}",
                       param="tools")
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}",
                           param=f"tools[{i}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        checked(Constraint.json_schema, params, f"tools[{i}].function.parameters")
        functions[fn["name"]] = params
    return functions


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, parser: str) -> ToolPlan | None:
    """The ``ToolPlan`` of a request (None without tools).

    Args:
        tools: the request's ``tools`` field, or None.
        tool_choice: the request's ``tool_choice`` field, or None (``"auto"``).
        parallel_tool_calls: the request's ``parallel_tool_calls`` (None: allowed).
        parser: the tool-call parser's name for ``"auto"``.

    Returns:
        The plan, or None without tools.

    Raises:
        APIError: 400 for bad tools, a ``tool_choice`` that is not one of the four forms or names an unknown
            function, or a ``tool_choice`` without tools.
    """
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
        return None
    functions = check_tools(tools)
    parallel = parallel_tool_calls is not False
    name = None
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        choice, name = "named", tool_choice["function"].get("name")
        if name not in functions:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                                f"{sorted(functions)}", param="tool_choice")
    else:
        raise APIError(400, f"tool_choice={tool_choice!r}: expected 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    constraint = None
    if choice == "named":
        constraint = Constraint.json_schema(functions[name])
    elif choice == "required":
        one_of = [{"type": "object", "properties": {"name": {"const": fn}, "arguments": params},
                   "required": ["name", "arguments"], "additionalProperties": False}
                  for fn, params in functions.items()]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        constraint = Constraint.json_schema(schema)
    return ToolPlan(list(tools), choice, name, parallel, parser, constraint)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's ``tool_calls`` arguments (JSON text in the OpenAI
    API) as objects, as ``transformers``' templates expect (``arguments | tojson``).

    Args:
        messages: the request's messages.

    Returns:
        The messages, with arguments that are valid JSON text parsed (others left as they are).
    """
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except json.JSONDecodeError:
                        pass
                    call = {**call, "function": fn}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


def decode_keeping(tokenizer: Any, token_ids: list[int], markers: tuple[str, ...]) -> str:
    """``token_ids`` decoded without the special tokens except ``markers`` (a parser's ``[TOOL_CALLS]`` …).

    Args:
        tokenizer: the model's tokenizer (or its ``backend``, a ``tokenizers.Tokenizer``).
        token_ids: the answer's tokens.
        markers: the special tokens to keep.

    Returns:
        The decoded text.
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else {}
    kept = [t for t in token_ids if t not in added or not added[t].special or added[t].content in markers]
    return backend.decode(kept, skip_special_tokens=False)


def answer(plan: ToolPlan | None, tokenizer: Any, token_ids: list[int], text: str, stream: bool
           ) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A chat answer's ``content`` and ``tool_calls`` (None: no calls) under ``plan``; streamed calls carry their
    ``index``.

    Args:
        plan: the request's tool plan, or None.
        tokenizer: decodes the answer keeping the parser's markers (None: ``text`` is parsed).
        token_ids: the answer's tokens.
        text: the answer's text (special tokens skipped).
        stream: whether the calls go out in a streamed delta.

    Returns:
        ``(content, tool_calls)`` in OpenAI's shape; ``(text, None)`` when the answer holds no calls.
    """
    if plan is None or plan.choice == "none":
        return text, None
    markers = MARKERS.get(plan.parser, ())
    raw = decode_keeping(tokenizer, token_ids, markers) if plan.choice == "auto" and markers and tokenizer else text
    content, calls = plan.message(raw)
    if not calls:
        return text, None
    return content, [call.to_openai(i if stream else None) for i, call in enumerate(calls)]
