"""Tool-call parsers on the formats the families' published templates and model cards show, the parser chosen from
a template, and the answer decoded with the special tokens a parser reads (``[TOOL_CALLS]``)."""

from __future__ import annotations

import json

import pytest

from serving.structured import decode_keeping
from serving.tool_parsers import PARSERS, parse_tool_calls, parser_for
from tokenization import train_byte_level_bpe


def calls(text: str, parser: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, found = parse_tool_calls(text, parser)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


PARIS = ("get_weather", {"location": "Paris, France", "unit": "celsius"})
OSLO = ("get_time", {"zone": "CET"})


@pytest.mark.parametrize(("parser", "text", "want"), [
    # Qwen 2.5 / Qwen 3 / Hermes 2 Pro: one block per call, newlines inside.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     (None, [PARIS, OSLO])),
    ("hermes", 'Sure, checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     ("Sure, checking.", [OSLO])),
    ("hermes", "No tools needed: it is sunny.", ("No tools needed: it is sunny.", [])),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", ("<tool_call>\n{not json}\n</tool_call>", [])),
    # Llama 3.1-3.3 JSON tool calling (parameters, optional python tag, ';' between calls).
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris, France", '
                    '"unit": "celsius"}}', (None, [PARIS])),
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', (None, [PARIS, OSLO])),
    ("llama3_json", "It is sunny in Paris.", ("It is sunny in Paris.", [])),
    # Mistral v3 (JSON list) and v11+ (name[ARGS]json) tokenizers.
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": '
                '"celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]', (None, [PARIS, OSLO])),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris, France", "unit": "celsius"}[TOOL_CALLS]get_time'
                '[ARGS]{"zone": "CET"}', (None, [PARIS, OSLO])),
    ("mistral", "Bonjour!", ("Bonjour!", [])),
    # Llama 3.2 / 4 pythonic lists.
    ("pythonic", "[get_weather(location='Paris, France', unit='celsius'), get_time(zone=\"CET\")]",
     (None, [PARIS, OSLO])),
    ("pythonic", "[print(open('x'))]", ("[print(open('x'))]", [])),
    # The fallback: a bare call object or a list of them, else pythonic.
    ("json", '{"name": "get_time", "arguments": {"zone": "CET"}}', (None, [OSLO])),
    ("json", '[{"name": "get_time", "parameters": {"zone": "CET"}}]', (None, [OSLO])),
    ("json", "get_time(zone='CET')", (None, [OSLO])),
    ("json", "just words", ("just words", [])),
])
def test_parsers_read_the_published_formats(parser: str, text: str, want: tuple) -> None:
    assert calls(text, parser) == want


def test_the_parser_is_chosen_from_the_template_or_by_name() -> None:
    qwen = "{%- if tools %}...<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args>}\\n</tool_call>"
    llama = "{%- if builtin_tools is defined %}...<|python_tag|>...{{- '<|start_header_id|>ipython<|end_header_id|>' }}"
    mistral = "{%- elif message.tool_calls is defined %}{{- '[TOOL_CALLS] [' }}"
    assert [parser_for(t) for t in (qwen, llama, mistral, "{{ messages }}", None)] == \
        ["hermes", "llama3_json", "mistral", "json", "json"]
    assert parser_for(qwen, "pythonic") == "pythonic" and set(PARSERS) >= {"hermes", "llama3_json", "mistral",
                                                                            "pythonic", "json"}
    with pytest.raises(ValueError, match="not one of"):
        parser_for(None, "nope")


def test_special_markers_survive_decoding_for_their_parser() -> None:
    tok = train_byte_level_bpe(["get_time zone CET"] * 4, vocab_size=280, min_frequency=1)
    tok.backend.add_special_tokens(["[TOOL_CALLS]"])
    ids = tok.encode('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]',
                     add_special_tokens=False) + [tok.eos_token_id]
    assert "[TOOL_CALLS]" not in tok.decode(ids)  # what the engine's text holds
    text = decode_keeping(tok, ids, ("[TOOL_CALLS]",))
    assert text.startswith("[TOOL_CALLS]") and calls(text, "mistral") == (None, [OSLO])
