"""JSON Lines training files (one JSON object per line): conversations for chat SFT, preference pairs for DPO.

Every problem is a ``ValueError`` that names the file and the 1-based line: bytes that are not UTF-8, a line that is
not JSON or not an object, a conversation without roles or with an empty assistant turn, a preference pair with a
missing or empty field. Blank lines are skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: The roles a conversation's messages may take.
ROLES = ("system", "developer", "user", "assistant", "tool")


def read_jsonl(path: str | os.PathLike[str]) -> list[tuple[int, dict[str, Any]]]:
    """The objects of a JSON Lines file with their line numbers.

    Args:
        path: the JSON Lines file.

    Returns:
        ``[(line_number, object), ...]`` (1-based line numbers; blank lines skipped).

    Raises:
        ValueError: a missing file, bytes that are not UTF-8, a line that is not a JSON object, or no objects.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; expected a JSON Lines file")
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}, line {number}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(value).__name__}")
            rows.append((number, value))
    if not rows:
        raise ValueError(f"{path}: no JSON objects; expected one per line")
    return rows


def check_messages(messages: Any, where: str, *, needs_assistant: bool = True) -> list[dict[str, Any]]:
    """Validate one conversation's messages.

    Args:
        messages: the ``messages`` value of one line.
        where: ``"FILE, line N"`` for the messages.
        needs_assistant: require at least one assistant turn (SFT has nothing to learn otherwise).

    Returns:
        The messages.

    Raises:
        ValueError: not a non-empty list of dicts, a missing or unknown role, content that is not a string (or
            None beside ``tool_calls``), an assistant turn with neither content nor tool calls, or no assistant turn.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects, "
                         f"got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{i}] must be an object, got {message!r:.80}")
        role = message.get("role")
        if role is None:
            raise ValueError(f"{where}: messages[{i}] has no 'role'; expected one of {list(ROLES)}")
        if role not in ROLES:
            raise ValueError(f"{where}: messages[{i}] has role {role!r}; expected one of {list(ROLES)}")
        content = message.get("content")
        calls = message.get("tool_calls")
        if content is None and not (role == "assistant" and calls):
            raise ValueError(f"{where}: messages[{i}] ({role}) has no 'content'")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: messages[{i}] ({role}) content must be a string, got {content!r:.80}")
        if role == "assistant" and not (content or "").strip() and not calls:
            raise ValueError(f"{where}: messages[{i}] is an empty assistant turn; there is nothing to learn from it")
    if needs_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn; there is nothing to learn from it")
    return messages


def read_conversations(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Conversations from a JSON Lines file: ``{"messages": [...], "tools": [...]?}`` per line.

    Args:
        path: the JSON Lines file.

    Returns:
        ``[{"messages": [...], "tools": [...] or None}, ...]``.

    Raises:
        ValueError: as ``read_jsonl`` and ``check_messages``, or a ``tools`` value that is not a list of objects.
    """
    out = []
    for number, row in read_jsonl(path):
        where = f"{path}, line {number}"
        if "messages" not in row:
            raise ValueError(f"{where}: no 'messages' key (keys: {sorted(row)})")
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"{where}: 'tools' must be a list of JSON schema objects, got {tools!r:.80}")
        out.append({"messages": check_messages(row["messages"], where), "tools": tools})
    return out


def read_preferences(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Preference pairs from a JSON Lines file: ``{"prompt", "chosen", "rejected"}`` per line, each a string, or
    (conversational, as TRL takes them) ``prompt`` a list of messages and ``chosen``/``rejected`` lists of assistant
    messages.

    Args:
        path: the JSON Lines file.

    Returns:
        ``[{"prompt", "chosen", "rejected"}, ...]``, one dict per line with those three fields only.

    Raises:
        ValueError: as ``read_jsonl``, a missing field, an empty completion, or fields of mixed kinds.
    """
    out = []
    for number, row in read_jsonl(path):
        where = f"{path}, line {number}"
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise ValueError(f"{where}: missing {missing}; expected 'prompt', 'chosen' and 'rejected'")
        kinds = {type(row[k]) for k in ("prompt", "chosen", "rejected")}
        if kinds == {str}:
            for key in ("chosen", "rejected"):
                if not row[key].strip():
                    raise ValueError(f"{where}: '{key}' is empty; expected a completion to compare")
        elif kinds == {list}:
            check_messages(row["prompt"], f"{where} (prompt)", needs_assistant=False)
            for key in ("chosen", "rejected"):
                turns = check_messages(row[key], f"{where} ({key})")
                if any(m["role"] != "assistant" for m in turns):
                    raise ValueError(f"{where}: '{key}' must hold assistant messages only")
        else:
            raise ValueError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all be lists of "
                             f"messages, got {sorted(t.__name__ for t in kinds)}")
        out.append({k: row[k] for k in ("prompt", "chosen", "rejected")})
    return out
