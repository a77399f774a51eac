"""A hostile client of a shared server, with the official ``openai`` client: every hostile request is a 4xx in
OpenAI's shape naming its field (content that is not text, lone surrogates, seeds beyond int64, a template that
would loop or allocate without end on this request's messages) or is served (``top_p=1e-300``: greedy), while
innocent streams running at the same time get exactly what they get alone, and the answer to a fixed greedy request
is the same before and after."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from models import DecoderLM
from serving.openai_api import create_app
from tokenization import Tokenizer

from .test_server import KEY, TEMPLATE, Served, reference, tokenizer

#: The test server's template, made hostile by the last message: "spin" loops 1e10 times, "grow" builds 10 GB.
HOSTILE_TEMPLATE = ("{% if messages[-1].content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{% endfor %}{% endfor %}{% elif messages[-1].content == 'grow' %}{{ 'x' * 10**10 }}{% endif %}"
                    + TEMPLATE)
INNOCENT = [[{"role": "user", "content": "hello there, how are you?"}],
            [{"role": "user", "content": "the quick brown fox"}],
            [{"role": "user", "content": "jumps over the lazy dog today"}]]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[DecoderLM, Tokenizer, Served, openai.OpenAI]]:
    tok = tokenizer()
    tok = Tokenizer(tok.backend, chat_template=HOSTILE_TEMPLATE)
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=len(tok), d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                  max_len=128, dropout=0.0, eos_token_id=tok.token_to_id("<|im_end|>"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    server = Served(create_app(model.eval(), tok, model_name="tiny-chat", api_key=KEY, max_num_seqs=4))
    yield model, tok, server, openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    server.stop()


def chat(**fields: Any) -> Any:
    return lambda c: c.chat.completions.create(model="tiny-chat", **{"messages": INNOCENT[0], "max_tokens": 4,
                                                                      **fields})


def raw(path: str, **fields: Any) -> Any:
    """A request sent as JSON with ``\\uXXXX`` escapes: the ``openai`` client cannot encode a lone surrogate (it
    fails before sending), a hostile client writes the JSON itself."""

    def send(client: openai.OpenAI) -> Any:
        body = {"model": "tiny-chat", "max_tokens": 4, **fields}
        response = httpx.post(f"{client.base_url}{path}", content=json.dumps(body), timeout=30,
                              headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
        raise openai.BadRequestError(response.text, response=response, body=response.json()["error"])

    return send


HOSTILE = [
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "got int 5"),
    (chat(messages=[{"role": "user", "content": {"text": "hi"}}]), "messages[0].content", "got dict"),
    (chat(messages=[{"role": 5, "content": "hi"}]), "messages[0].role", "expected a string"),
    (raw("chat/completions", messages=[{"role": "user", "content": "hi \ud800"}]), "messages[0].content",
     "lone surrogate"),
    (raw("chat/completions", messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
     "messages[0].content[0].text", "lone surrogate"),
    (raw("chat/completions", messages=INNOCENT[0], stop=["ok", "\ud800"]), "stop[1]", "lone surrogate"),
    (raw("completions", prompt="a \udc00 b"), "prompt", "lone surrogate"),
    (chat(seed=2**64), "seed", "less than or equal to 9223372036854775807"),
    (chat(seed=-(2**63) - 1), "seed", "greater than or equal to -9223372036854775808"),
    (chat(messages=[{"role": "user", "content": "grow"}]), "messages", r"operator '\*' would make a value"),
    (chat(messages=[{"role": "user", "content": "spin"}]), "messages", "time limit"),
]


def test_hostile_requests_are_4xx_naming_their_field_and_innocent_streams_are_unaffected(served) -> None:
    model, tok, _, client = served
    wants = [tok.decode(reference(model, tok, m, 12)) for m in INNOCENT]
    before = client.chat.completions.create(model="tiny-chat", messages=INNOCENT[0], temperature=0, max_tokens=12)
    assert before.choices[0].message.content == wants[0]
    got: dict[int, str] = {}

    def stream(i: int) -> None:  # an innocent client streaming while the hostile ones are answered
        for _ in range(3):
            chunks = client.chat.completions.create(model="tiny-chat", messages=INNOCENT[i], temperature=0,
                                                    max_tokens=12, stream=True)
            got[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert got[i] == wants[i]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(INNOCENT))]
    for thread in threads:
        thread.start()
    for call, param, message in HOSTILE:
        start = time.perf_counter()
        with pytest.raises(openai.BadRequestError) as err:
            call(client)
        assert time.perf_counter() - start < 2.5
        body = err.value.body
        assert set(body) == {"message", "type", "param", "code"} and body["param"] == param, body
        assert err.value.status_code == 400 and err.match(message)
    # The request (a nucleus that underflows float32): served, as greedy decoding.
    tiny_p = client.chat.completions.create(model="tiny-chat", messages=INNOCENT[1], temperature=1.0, top_p=1e-300,
                                            max_tokens=12)
    assert tiny_p.choices[0].message.content == wants[1]
    for thread in threads:
        thread.join(timeout=60)
    assert got == dict(enumerate(wants))
    after = client.chat.completions.create(model="tiny-chat", messages=INNOCENT[0], temperature=0, max_tokens=12)
    assert after.choices[0].message.content == before.choices[0].message.content
