"""Every field of OpenAI's chat and completions requests is honoured or refused: none is silently dropped.

The request models (``serving.protocol``) declare the fields the server honours; the OpenAI-defined fields left
over (``model_extra``) are checked here:

- accepted, with no effect on the answer (the caller's bookkeeping): ``user``, ``metadata``,
  ``safety_identifier``, ``prompt_cache_key`` (the prefix cache is automatic), ``service_tier`` ``"auto"`` /
  ``"default"``, ``store`` false, ``modalities`` ``["text"]``, ``best_of`` equal to ``n``, an empty ``suffix``;
- refused with a 400 naming the field when set: the others (``audio``, ``prediction``, ``reasoning_effort``,
  ``verbosity``, ``web_search_options``, the deprecated ``functions`` / ``function_call`` — use ``tools``, ``store``
  true, other ``service_tier`` / ``modalities`` / ``best_of`` / ``suffix`` values).

Keys OpenAI does not define are ignored, as OpenAI-compatible servers do with extensions they do not know.
"""

from __future__ import annotations

from typing import Any

from .protocol import APIError

#: OpenAI-defined fields accepted whatever their value: they do not change the answer.
BOOKKEEPING = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})

#: OpenAI-defined fields accepted only with these values (None always is).
ACCEPTED_VALUES: dict[str, tuple[Any, ...]] = {
    "service_tier": ("auto", "default"), "store": (False,), "modalities": (["text"],), "suffix": ("",),
}

#: OpenAI-defined fields this server does not implement, and why / what to use instead.
REFUSED = {
    "audio": "audio output is not supported (text models)",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported by this server",
    "verbosity": "verbosity is not supported by this server",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated functions field is not supported: use tools",
    "function_call": "the deprecated function_call field is not supported: use tool_choice",
    "service_tier": "service_tier must be 'auto' or 'default'",
    "store": "this server stores no completions (store must be false)",
    "modalities": "modalities must be ['text']",
    "suffix": "suffix is not supported (no insertion)",
    "best_of": "best_of must equal n (candidates are not ranked)",
}


def check_openai_fields(extra: dict[str, Any] | None, n: int = 1) -> None:
    """Refuse the OpenAI-defined fields of a request that the server does not honour.

    Args:
        extra: the request's fields not declared by its model (pydantic's ``model_extra``).
        n: the request's ``n`` (``best_of`` must equal it).

    Raises:
        APIError: 400 naming the first refused field.
    """
    for name, value in (extra or {}).items():
        if name in BOOKKEEPING or value is None or name not in REFUSED:
            continue
        if name == "best_of" and value == n:
            continue
        if name in ACCEPTED_VALUES and value in ACCEPTED_VALUES[name]:
            continue
        raise APIError(400, f"{name}={value!r:.80}: {REFUSED[name]}", param=name, code="unsupported_field")
