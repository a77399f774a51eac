"""Structured outputs and tool calls over HTTP, driven by the official ``openai`` client against one shared server
(a tiny random model; the engine in a thread of the server: constraints cross to an engine process as plain
picklable values, tests/serving/test_engine_constraints.py): ``chat.completions.parse`` with a
pydantic model, tool calls round-tripping through a Hermes-style template (``required``, named and ``auto``,
streamed and not), ``logit_bias`` bans, and every OpenAI field honoured or refused with a 400 naming it."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from models import DecoderLM
from serving import cli
from serving.engine import Engine
from serving.openai_api import create_app
from serving.structured import template_messages
from tests.serving.test_server import Served
from tokenization import Tokenizer, train_byte_level_bpe

# Hermes / Qwen 2.5 style: tools in the system turn, calls in <tool_call> blocks, results in <tool_response>.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KEY = "sk-structured"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=20)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[DecoderLM, Tokenizer, Served]]:
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris"}} the weather is sunny', "hello there"] * 4
    tok = train_byte_level_bpe(corpus, vocab_size=320, min_frequency=1)
    tok.backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok = Tokenizer(tok.backend, chat_template=TEMPLATE)
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=len(tok), d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                  max_len=512, eos_token_id=tok.token_to_id("<|im_end|>")).eval()
    server = Served(create_app(model, tok, model_name="tiny", api_key=KEY, max_num_seqs=4))
    yield model, tok, server
    server.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[2].url + "/v1", api_key=KEY, max_retries=0)


def test_parse_with_a_pydantic_model_returns_the_object(client) -> None:
    for temperature in (0, 1.2):
        answer = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Pet, max_tokens=40,
                                               temperature=temperature, seed=1)
        pet = answer.choices[0].message.parsed
        assert isinstance(pet, Pet) and answer.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0)
    assert obj.choices[0].message.content.startswith("{")


def test_structured_outputs_regex_choice_and_grammar_on_both_endpoints(client) -> None:
    answer = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=20, temperature=0,
                                            extra_body={"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}})
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", answer.choices[0].message.content)
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=1.0, n=3, seed=2,
                                     extra_body={"structured_outputs": {"choice": ["sunny", "rain"]}})
    assert {c.text for c in done.choices} <= {"sunny", "rain"}
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=40, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].text.startswith("{")
    grammar = 'start: "(" NUM ")"\nNUM: /[0-9]{1,3}/'
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0,
                                     extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\([0-9]{1,3}\)", done.choices[0].text)


def tool_round_trip(client, tool_choice, stream: bool) -> tuple[list, str]:
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=80,
                  temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        reason = chunks[-1].choices[0].finish_reason
    else:
        message = client.chat.completions.create(**kwargs).choices[0]
        calls, reason = message.message.tool_calls, message.finish_reason
    return calls, reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_round_trip_with_required_and_named_choices(served, client, stream: bool) -> None:
    model, tok, _ = served
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        calls, reason = tool_round_trip(client, choice, stream)
        assert reason == "tool_calls" and calls and calls[0].id.startswith("call_")
        assert calls[0].function.name in ("get_weather", "get_time")
        args = json.loads(calls[0].function.arguments)
        schema = (WEATHER if calls[0].function.name == "get_weather" else TIME)["function"]["parameters"]
        assert set(args) == set(schema["required"])
        if choice is named:
            assert calls[0].function.name == "get_weather" and args["city"] in ("Paris", "Oslo")
    # The call and its result go back through the template; the final answer is what generate gives on those ids.
    call = {"id": calls[0].id, "type": "function",
            "function": {"name": calls[0].function.name, "arguments": calls[0].function.arguments}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                           max_tokens=8, temperature=0)
    ids = tok.apply_chat_template(template_messages(history), add_generation_prompt=True, tools=[WEATHER, TIME])
    assert "<tool_call>" in tok.decode(ids, skip_special_tokens=False) and "sunny, 21 C" in tok.decode(ids)
    want = model.generate(torch.tensor([ids]), max_new_tokens=8)[0, len(ids):].tolist()
    want = want[:want.index(model.config.eos_token_id)] if model.config.eos_token_id in want else want
    assert final.choices[0].message.content == tok.decode(want) and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_family_format(client, stream: bool) -> None:
    # The model is made to write a Hermes call (a choice constraint); auto mode reads it back as a tool call.
    said = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"choice": [said]}})
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content, calls = message.content, message.tool_calls
    assert content == "Let me check." and len(calls) == 1
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Oslo",
                                                                                                    "days": 2}


def test_logit_bias_minus_100_bans_tokens(served, client) -> None:
    model, tok, _ = served
    free = Engine(model, tok).generate([[5, 6, 7]], max_tokens=6)[0]
    bias = {str(t): -100 for t in free.token_ids}
    answer = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0, logit_bias=bias)
    banned = Engine(model, tok).generate([[5, 6, 7]], max_tokens=6, logit_bias=bias)[0]
    assert not set(banned.token_ids) & set(free.token_ids)
    assert answer.choices[0].text == banned.text != free.text


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"store": True}, "store"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_unsupported_or_invalid_fields_are_400_naming_them(served, body: dict, param: str) -> None:
    response = httpx.post(served[2].url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "messages": ASK, "max_tokens": 2, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_bookkeeping_fields_are_accepted_and_unknown_keys_ignored(served) -> None:
    for endpoint, extra in [("chat/completions", {"messages": ASK, "user": "u1", "metadata": {"a": "b"}, "store": False,
                                                  "service_tier": "auto", "my_extension": 1}),
                            ("completions", {"prompt": "hi", "best_of": 1, "suffix": "", "user": "u"})]:
        response = httpx.post(f"{served[2].url}/v1/{endpoint}", headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": "tiny", "max_tokens": 2, **extra}, timeout=30)
        assert response.status_code == 200, response.text
    response = httpx.post(f"{served[2].url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "prompt": "hi", "suffix": "end"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"


def test_zoo_generate_and_chat_with_a_regex_or_a_json_schema(served, tmp_path) -> None:
    model, tok, _ = served
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    schema = tmp_path / "pet.json"
    schema.write_text(json.dumps({**Pet.model_json_schema(), "additionalProperties": False}))
    out = io.StringIO()
    cli.generate(cli.parser().parse_args(["generate", str(tmp_path / "m"), "hello", "--max-tokens", "12",
                                          "--regex", "[0-9]{3}-[a-z]{2}"]), stdout=out)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}\n", out.getvalue())
    out = io.StringIO()
    cli.chat(cli.parser().parse_args(["chat", str(tmp_path / "m"), "--max-tokens", "40", "--json-schema",
                                      str(schema)]), stdin=io.StringIO("a pet?\nanother?\n"), stdout=out)
    answers = [line.removeprefix("> ") for line in out.getvalue().split("\n")[:2]]
    assert all(isinstance(Pet.model_validate_json(a), Pet) for a in answers)
    with pytest.raises(SystemExit, match="invalid regex"):
        cli.main(["generate", str(tmp_path / "m"), "x", "--regex", "a("])
