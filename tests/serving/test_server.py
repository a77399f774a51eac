"""The OpenAI-compatible server, driven by the official ``openai`` client (and raw HTTP for malformed requests) on a
port the test picks on 127.0.0.1: answers equal ``DecoderLM.generate`` on the chat template's ids, streaming equals
the whole answer, errors have OpenAI's shape and status, metrics count what was served. The shared server runs its
engine in an engine process (``ProcessEngine``, as ``zoo serve`` does); one test covers the in-process thread engine."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from models import DecoderLM, EncoderLM
from models.generation.sampling import SamplingParams
from serving import cli
from serving.async_engine import EngineDeadError
from serving.engine_process import ModelSource, ProcessEngine
from serving.openai_api import create_app
from tests.serving.conftest import failing_on
from tokenization import Tokenizer, train_byte_level_bpe

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
KEY = "sk-test"
#: A token id that no other test sends; a forward holding 8 or more of it (only a prefill can: at most 4 rows decode
#: together) raises inside the engine process.
TRIGGER = 4


def tokenizer() -> Tokenizer:
    corpus = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today?"] * 4
    tok = train_byte_level_bpe(corpus, vocab_size=300, min_frequency=1)
    tok.backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(tok.backend, chat_template=TEMPLATE)


class Served:
    """A uvicorn server of ``app`` in a thread, on a free port of 127.0.0.1; ``stop()`` ends it."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[DecoderLM, Tokenizer, Served]]:
    tok = tokenizer()
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=len(tok), d_model=32, n_heads=4, n_layers=2, d_ff=64,
                                  max_len=128, dropout=0.0, eos_token_id=tok.token_to_id("<|im_end|>"))
    with torch.no_grad():  # larger than the 0.02-std init: greedy text that is not one repeated token
        for p in model.parameters():
            p.mul_(8.0)
    source = ModelSource(factory=functools.partial(failing_on, ModelSource.from_model(model).factory, TRIGGER))
    served = Served(create_app(model.eval(), tok, model_name="tiny-chat", api_key=KEY, max_num_seqs=4,
                               engine_process=source, max_loras=1))  # a LoRA slot: test_server_lora
    yield model, tok, served
    served.stop()


def scrape(url: str) -> dict[str, float]:
    """The server's metrics by name."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def client(setup) -> openai.OpenAI:
    return openai.OpenAI(base_url=setup[2].url + "/v1", api_key=KEY, max_retries=0)


MESSAGES = [{"role": "user", "content": "hello there, how are you?"}]


def reference(model: DecoderLM, tok: Tokenizer, messages: list, max_tokens: int) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, eos_token_id=model.config.eos_token_id)
    new = out[0, len(ids):].tolist()
    return new


def test_chat_completion_equals_generate_on_the_template_ids(setup, client) -> None:
    model, tok, _ = setup
    answer = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=0, max_tokens=12)
    want = reference(model, tok, MESSAGES, 12)
    assert len(set(want)) > 3  # a varied answer
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == tok.decode(want)
    assert answer.choices[0].finish_reason in ("stop", "length")
    prompt_len = len(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert answer.usage.prompt_tokens == prompt_len and answer.usage.completion_tokens == len(want)


def test_streaming_equals_the_whole_answer_and_ends_with_usage(setup, client) -> None:
    whole = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = httpx.post(setup[2].url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 3, "stream": True}, timeout=30)
    assert raw.text.endswith("data: [DONE]\n\n") and raw.headers["content-type"].startswith("text/event-stream")


def test_presence_and_frequency_penalties_equal_generate_with_them(setup, client) -> None:
    model, tok, _ = setup
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    params = SamplingParams(presence_penalty=1.5, frequency_penalty=1.0)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, eos_token_id=model.config.eos_token_id,
                         sampling=params)
    want = out[0, len(ids):].tolist()
    answer = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=0, max_tokens=12,
                                            presence_penalty=1.5, frequency_penalty=1.0)
    assert answer.choices[0].message.content == tok.decode(want)
    assert want != reference(model, tok, MESSAGES, 12)  # the penalties change this answer


def test_completions_with_token_ids_logprobs_and_n(setup, client) -> None:
    model, tok, _ = setup
    prompt = tok.encode("the quick brown", add_special_tokens=False)
    answer = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, eos_token_id=model.config.eos_token_id)
    want = out[0, len(prompt):].tolist()
    assert answer.choices[0].text == tok.decode(want)
    with torch.no_grad():  # the chosen tokens' log-probabilities under the model, computed independently
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1:]
    expected = torch.log_softmax(logits, -1)[torch.arange(len(want)), torch.tensor(want)]
    got = torch.tensor(answer.choices[0].logprobs.token_logprobs)
    torch.testing.assert_close(got, expected[: len(got)], atol=1e-4, rtol=1e-4)
    # Greedy: each chosen token is the most likely, so it tops its top-2 (keyed by text: two ids may share one).
    for top, chosen in zip(answer.choices[0].logprobs.top_logprobs, got.tolist(), strict=True):
        assert len(top) in (1, 2) and max(top.values()) == pytest.approx(chosen, abs=1e-6)
    sampled = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, n=3, seed=7,
                                        temperature=1.0)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    again = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, n=3, seed=7, temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded


@pytest.mark.parametrize(("call", "status", "param"), [
    (lambda c: c.chat.completions.create(model="nope", messages=MESSAGES), 404, "model"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=MESSAGES, n=0), 400, "n"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=5), 400, "temperature"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=MESSAGES, presence_penalty=2.5), 400,
     "presence_penalty"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=MESSAGES, frequency_penalty=-3), 400,
     "frequency_penalty"),
    (lambda c: c.completions.create(model="tiny-chat", prompt=[5] * 200, max_tokens=4), 400, "prompt"),
    (lambda c: c.completions.create(model="tiny-chat", prompt=[10**6], max_tokens=4), 400, "prompt"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", max_tokens=0), 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors(client, call, status: int, param: str) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        call(client)
    assert err.value.status_code == status
    body = err.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param and body["message"]


def test_malformed_json_missing_key_and_wrong_key(setup) -> None:
    url = setup[2].url
    bad = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        denied = httpx.get(url + "/v1/models", headers=headers, timeout=30)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-chat"]


def test_metrics_count_what_was_served(setup, client) -> None:
    before = scrape(setup[2].url)
    answer = client.completions.create(model="tiny-chat", prompt="hello there", max_tokens=5, temperature=0)
    after = scrape(setup[2].url)
    assert after["zoo_generation_tokens_total"] - before["zoo_generation_tokens_total"] == \
        answer.usage.completion_tokens
    assert after["zoo_prompt_tokens_total"] - before["zoo_prompt_tokens_total"] == answer.usage.prompt_tokens
    assert after["zoo_time_to_first_token_seconds_count"] == before["zoo_time_to_first_token_seconds_count"] + 1
    assert after["zoo_kv_blocks_total"] > 0 and after["zoo_requests_running"] == 0
    assert 0.0 <= after["zoo_prefix_cache_hit_rate"] <= 1.0


def test_health_is_503_until_the_model_is_loaded_and_embeddings_equal_embed() -> None:
    tok = tokenizer()
    app = create_app(model_name="embedder")
    served = Served(app)
    try:
        assert httpx.get(served.url + "/health", timeout=30).status_code == 503
        torch.manual_seed(0)
        model = EncoderLM.from_preset("tiny", vocab_size=len(tok), d_model=32, n_heads=4, n_layers=1, d_ff=64,
                                      head="embedding", options={"head": {"pooling": "mean", "normalize": True}})
        model.tokenizer = tok
        app.state.load(model.eval(), tok)
        assert httpx.get(served.url + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        texts = ["the quick brown fox", "hello there"]
        want = model.embed(texts)
        for encoding in ({}, {"encoding_format": "float"}):  # untold, the client asks for base64 and decodes it
            got = client.embeddings.create(model="embedder", input=texts, **encoding)
            torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), want, atol=1e-6, rtol=1e-6)
        with pytest.raises(openai.BadRequestError, match="embedding head"):
            client.chat.completions.create(model="embedder", messages=MESSAGES)
    finally:
        served.stop()


@pytest.fixture(scope="module")
def folder(setup, tmp_path_factory) -> Path:
    model, tok, _ = setup
    path = tmp_path_factory.mktemp("chat-model")
    model.save_pretrained(path, tokenizer=tok)
    assert (path / "chat_template.jinja").read_text() == TEMPLATE
    return path


def test_zoo_chat_answers_each_turn_as_generate_does(setup, folder: Path) -> None:
    model, tok, _ = setup
    out = io.StringIO()
    cli.chat(cli.parser().parse_args(["chat", str(folder), "--max-tokens", "8", "--temp", "0"]),
             stdin=io.StringIO("hello there\nhow are you?\n\n"), stdout=out)
    answers = [re.sub(r" \[cut at the 8-token limit; raise it with --max-tokens\]$", "", line.removeprefix("> "))
               for line in out.getvalue().split("\n")[:2]]
    messages = [{"role": "user", "content": "hello there"}]
    first = tok.decode(reference(model, tok, messages, 8))
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "how are you?"}]
    assert answers == [first, tok.decode(reference(model, tok, messages, 8))]


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux ``/proc``)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile
    below, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        below += children
        frontier = children
    return below


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and waiting to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_an_engine_process_ends_when_its_server_process_is_killed(folder: Path) -> None:
    script = ("import asyncio, sys\n"
              "from serving.engine_process import ModelSource, ProcessEngine\n"
              "async def main():\n"
              "    front = ProcessEngine(ModelSource(path=sys.argv[1]))\n"
              "    await front.start()\n"
              "    print(front.pid, flush=True)\n"
              "    await asyncio.sleep(600)\n"
              "asyncio.run(main())\n")
    server = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        engine = int(server.stdout.readline())
        assert engine in descendants(server.pid)
        server.kill()  # SIGKILL: nothing of the server runs; the engine process sees its pipe close
        server.wait(timeout=30)
        deadline = time.monotonic() + 30
        while running(engine):
            assert time.monotonic() < deadline, f"the engine process {engine} outlived its server"
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait(timeout=30)


def test_zoo_serve_runs_as_a_console_command(folder: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "serving.cli", "serve", str(folder), "--port", str(port),
               "--served-model-name", "mine", "--max-batch", "2", "--eager"]  # no compile in this test's time
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "zoo serve did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model="mine", messages=MESSAGES, temperature=0, max_tokens=4)
        assert answer.usage.completion_tokens >= 1 and answer.model == "mine"
        engines = descendants(process.pid)  # the engine process (and multiprocessing's resource tracker)
        assert engines and all(_command(pid).startswith(sys.executable) for pid in engines)
        # SIGTERM while a stream is in flight: the stream is finished (every token, then [DONE]), then the
        # server exits cleanly.
        stream = client.completions.create(model="mine", prompt="hello there", max_tokens=90, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = [next(stream)]
        process.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].usage.completion_tokens == 90  # nothing cut short ("length": all 90 tokens)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        # uvicorn shuts down gracefully (requests in flight finish, then the application's shutdown closes the
        # engine), then exits by the signal it caught.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        log = process.stdout.read().decode()
        assert "Application shutdown complete" in log and "Finished server process" in log, log
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in engines):  # no orphan
            assert time.monotonic() < deadline, f"left running: {[_command(p) for p in engines]}"
            time.sleep(0.05)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_concurrent_async_clients_each_get_what_they_get_alone(setup) -> None:
    model, tok, served = setup
    conversations = [[{"role": "user", "content": text}] for text in
                     ("hello there", "the quick brown fox", "how are you today?", "lazy dog", "hello")]

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
        try:
            calls = [client.chat.completions.create(model="tiny-chat", messages=m, temperature=0, max_tokens=6 + i)
                     for i, m in enumerate(conversations)]
            return [a.choices[0].message.content for a in await asyncio.gather(*calls)]
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == [tok.decode(reference(model, tok, m, 6 + i)) for i, m in enumerate(conversations)]


def test_n_choices_are_distinct_samples(client) -> None:
    answer = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, n=4, temperature=1.5,
                                            max_tokens=10, seed=3)
    texts = [c.message.content for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3] and len(set(texts)) > 1


def test_clients_dropping_mid_stream_free_every_block(setup, client) -> None:
    url = setup[2].url
    for i in range(12):
        with httpx.stream("POST", url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                          json={"model": "tiny-chat", "prompt": "hello there " * (1 + i % 3), "max_tokens": 60,
                                "stream": True, "temperature": 0, "stop": "\u2603"}) as response:
            next(response.iter_lines())  # the first chunk, then the client goes away
    deadline = time.monotonic() + 30
    while True:
        values = scrape(url)
        if values["zoo_kv_blocks_in_use"] == 0 and values["zoo_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks still held after the clients left: {values}"
        time.sleep(0.1)
    answer = client.completions.create(model="tiny-chat", prompt="hello", max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens >= 1  # and the server still answers


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"n": 10**4}, "n"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
])
def test_absurd_fields_are_400_naming_them(setup, body: dict, param: str) -> None:
    response = httpx.post(setup[2].url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                          json={"model": "tiny-chat", "prompt": "hello", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_invalid_utf8_a_failing_request_and_a_full_queue(setup, monkeypatch) -> None:
    model, tok, served = setup
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    bad = httpx.post(served.url + "/v1/completions", content=b'{"model": "tiny-chat", "prompt": "\xff\xfe"}',
                     headers=headers, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["message"]
    # One request that fails inside the server: a 500 in OpenAI's shape; the next request is served.
    real = Tokenizer.apply_chat_template

    def broken(self, messages, **kwargs):
        if messages[-1]["content"] == "break":
            raise RuntimeError("template machinery failed")
        return real(self, messages, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", broken)
    failed = httpx.post(served.url + "/v1/chat/completions", headers=headers, timeout=30,
                        json={"model": "tiny-chat", "messages": [{"role": "user", "content": "break"}]})
    assert failed.status_code == 500 and "template machinery failed" in failed.json()["error"]["message"]
    ok = httpx.post(served.url + "/v1/chat/completions", headers=headers, timeout=30,
                    json={"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200
    # A full waiting queue: 503 with Retry-After.
    engine = served.server.config.app.state.engine
    monkeypatch.setattr(engine, "max_waiting", 0)
    busy = httpx.post(served.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "tiny-chat", "prompt": "hello", "max_tokens": 2})
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "queue_full"


def test_zoo_chat_commands_and_ctrl_c_stop_only_the_reply(setup, folder: Path) -> None:
    model, tok, _ = setup

    class Interrupting(io.StringIO):
        """A terminal whose user presses Ctrl-C while the first reply is being written."""

        def __init__(self) -> None:
            super().__init__()
            self.writes = 0

        def write(self, text: str) -> int:
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt
            return super().write(text)

    out = Interrupting()
    script = "hello there\n/system Be terse.\nhow are you?\n/reset\n/exit\nnever read\n"
    cli.chat(cli.parser().parse_args(["chat", str(folder), "--max-tokens", "8", "--temp", "0"]),
             stdin=io.StringIO(script), stdout=out)
    text = out.getvalue()
    assert "[stopped]" in text and "never read" not in text
    assert "[system message set; history cleared]" in text
    assert "[history cleared; the system message is kept (/system alone removes it)]" in text
    # After /system the history is empty: the second answer is the one for [system, user] alone.
    turn = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "how are you?"}]
    assert tok.decode(reference(model, tok, turn, 8)) in text


def test_zoo_generate_embed_and_help(setup, folder: Path, capsys) -> None:
    model, tok, _ = setup
    out = io.StringIO()
    cli.generate(cli.parser().parse_args(["generate", str(folder), "the quick brown", "--max-tokens", "5"]),
                 stdout=out)
    ids = tok.encode("the quick brown")
    want = model.generate(torch.tensor([ids]), max_new_tokens=5, eos_token_id=model.config.eos_token_id)
    assert out.getvalue() == tok.decode(want[0, len(ids):].tolist()) + "\n"
    for command in ("serve", "chat", "generate", "embed"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        shown = capsys.readouterr().out
        assert exit_.value.code == 0 and "usage: zoo " + command in shown
        assert ("--engine-process, --no-engine-process" in shown) == (command == "serve")
    with pytest.raises(SystemExit, match="has no embedding head"):
        cli.main(["embed", str(folder), "text"])


@pytest.fixture(scope="module")
def poisoned(setup) -> Iterator[tuple[list[int], int, Served]]:
    """A server (engine process) of the model with NaN in one embedding row ``bad``; the greedy tokens of [5, 9]."""
    model, tok, _ = setup
    want = model.generate(torch.tensor([[5, 9]]), max_new_tokens=4, eos_token_id=None)[0].tolist()
    bad = next(i for i in range(3, 300) if i not in want)  # a token the clean request never sees
    poisoned = DecoderLM(dataclasses.replace(model.config, tie_embeddings=False)).eval()  # NaN in one input row
    with torch.no_grad():
        poisoned.load_state_dict({**model.state_dict(), "lm_head.weight": model.embed_tokens.weight.clone()})
        poisoned.embed_tokens.weight[bad] = float("nan")
    served = Served(create_app(poisoned, tok, model_name="tiny-chat", engine_process=True))
    yield want, bad, served
    served.stop()


def test_nan_logits_fail_their_request_with_500_and_the_server_keeps_serving(setup, poisoned) -> None:
    tok = setup[1]
    want, bad, served = poisoned
    url = served.url + "/v1/completions"
    failed = httpx.post(url, json={"model": "tiny-chat", "prompt": [5, bad, 9], "max_tokens": 4}, timeout=30)
    assert failed.status_code == 500 and "NaN" in failed.json()["error"]["message"]
    with httpx.stream("POST", url, timeout=30, json={"model": "tiny-chat", "prompt": [bad], "max_tokens": 4,
                                                    "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert "NaN" in lines[-2] and lines[-1] == "data: [DONE]"
    fine = httpx.post(url, json={"model": "tiny-chat", "prompt": [5, 9], "max_tokens": 4, "temperature": 0},
                      timeout=30)
    assert fine.status_code == 200, fine.text
    assert fine.json()["choices"][0]["text"] == tok.decode(want[2:])
    assert scrape(served.url)["zoo_kv_blocks_in_use"] == 0


def test_a_dead_engine_process_fails_requests_in_flight_and_health_turns_503(poisoned) -> None:
    served = poisoned[2]  # the last test of this server: its engine process is killed
    front = served.server.config.app.state.engine
    url = served.url + "/v1/completions"
    with httpx.stream("POST", url, timeout=30, json={"model": "tiny-chat", "prompt": [5, 9], "max_tokens": 100,
                                                    "stream": True, "temperature": 0}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")  # streaming: in flight
        os.kill(front.pid, signal.SIGSTOP)  # frozen, so that a second request is in flight (waiting to be taken)
        answers: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: answers.append(httpx.post(
            url, json={"model": "tiny-chat", "prompt": [9, 5], "max_tokens": 4}, timeout=30)))
        thread.start()
        deadline = time.monotonic() + 30
        while front.open_requests < 2:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        os.kill(front.pid, signal.SIGKILL)
        rest = [line for line in lines if line]
    thread.join(30)
    assert rest[-1] == "data: [DONE]" and '"code": "engine_error"' in rest[-2]
    assert "the engine process exited (exit code -9)" in rest[-2]
    error = answers[0].json()["error"]  # not taken by the engine: 503, as a request after its death
    assert answers[0].status_code == 503 and set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "engine_dead" and "the engine process exited (exit code -9)" in error["message"]
    health = httpx.get(served.url + "/health", timeout=30)
    assert health.status_code == 503 and "exit code -9" in health.json()["message"]
    refused = httpx.post(url, json={"model": "tiny-chat", "prompt": [9, 5], "max_tokens": 4}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


@pytest.mark.parametrize(("text", "nbytes"), [("4096", 4096), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30),
                                              ("1.5G", 1_500_000_000), ("64kb", 64_000), ("3 gib", 3 * 2**30)])
def test_kv_cache_memory_sizes_parse_to_bytes(text: str, nbytes: int) -> None:
    args = cli.parser().parse_args(["serve", "m", "--kv-cache-memory", text])
    assert args.kv_cache_memory == nbytes and args.kv_blocks is None


@pytest.mark.parametrize("argv", [["--kv-cache-memory", "lots"], ["--kv-cache-memory", "0"],
                                  ["--kv-cache-memory", "1GiB", "--kv-blocks", "8"]])
def test_bad_kv_cache_memory_flags_exit_with_usage(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parser().parse_args(["serve", "m", *argv])
    assert exit_.value.code == 2 and "kv-cache-memory" in capsys.readouterr().err


def test_a_failing_engine_step_fails_its_requests_with_500_and_the_server_keeps_serving(setup) -> None:
    served = setup[2]
    headers = {"Authorization": f"Bearer {KEY}"}
    failed = httpx.post(served.url + "/v1/completions", headers=headers, timeout=30,
                        json={"model": "tiny-chat", "prompt": [5] + [TRIGGER] * 8, "max_tokens": 8})
    assert failed.status_code == 500 and "kernel exploded" in failed.json()["error"]["message"]
    values = scrape(served.url)
    assert values["zoo_kv_blocks_in_use"] == 0 and values["zoo_requests_running"] == 0  # aborted, blocks freed
    body = {"model": "tiny-chat", "prompt": [TRIGGER] * 9, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", headers=headers, timeout=30, json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert '"code": "engine_error"' in lines[-2] and lines[-1] == "data: [DONE]"  # streamed: an error event
    ok = httpx.post(served.url + "/v1/completions", headers=headers, timeout=30,
                    json={"model": "tiny-chat", "prompt": "hello there", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_the_in_process_thread_engine_serves_and_survives_a_failing_step(setup, monkeypatch) -> None:
    model, tok, _ = setup
    served = Served(create_app(model, tok, model_name="tiny-chat", max_num_seqs=4, engine_process=False))
    try:
        engine = served.server.config.app.state.engine.engine
        real, calls = engine.step, {"n": 0}

        def step_failing_once():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("kernel exploded")
            return real()

        monkeypatch.setattr(engine, "step", step_failing_once)
        url = served.url + "/v1/completions"
        failed = httpx.post(url, timeout=30, json={"model": "tiny-chat", "prompt": "hello there", "max_tokens": 8})
        assert failed.status_code == 500 and "kernel exploded" in failed.json()["error"]["message"]
        assert not engine.requests and engine.allocator.num_free == engine.allocator.n_blocks  # aborted, freed
        calls["n"] = 0
        with httpx.stream("POST", url, timeout=30,
                          json={"model": "tiny-chat", "prompt": "hello", "max_tokens": 8, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        assert '"code": "engine_error"' in lines[-2] and lines[-1] == "data: [DONE]"  # mid-stream: an error event
        answer = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="tiny-chat", messages=MESSAGES, temperature=0, max_tokens=12)
        assert answer.choices[0].message.content == tok.decode(reference(model, tok, MESSAGES, 12))
    finally:
        served.stop()


def test_bad_model_sources_and_an_engine_that_cannot_start(setup) -> None:
    with pytest.raises(ValueError, match="a path or a factory, exactly one"):
        ModelSource()
    with pytest.raises(ValueError, match="a path or a factory, exactly one"):
        ModelSource(path="x", factory=dict)
    with pytest.raises(ValueError, match="must be callable"):
        ModelSource(factory="not callable")
    with pytest.raises(ValueError, match="must be a ModelSource"):
        ProcessEngine("a path")
    front = ProcessEngine(ModelSource.from_model(setup[0]), max_num_seqs=0)  # refused in the engine process
    with pytest.raises(EngineDeadError, match="max_num_seqs must be a positive integer, got 0"):
        asyncio.run(front.start())
    assert not front.alive and not running(front.pid)


def test_zoo_serve_hands_its_engine_options_to_the_engine(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    import uvicorn

    from serving import cli, openai_api

    seen: dict = {}
    monkeypatch.setattr(openai_api, "create_app", lambda *args, **kwargs: seen.update(kwargs) or "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(app=app, **kwargs))
    cli.main(["serve", str(folder), "--compile-attention", "--max-batch", "3", "--port", "8123"])
    assert seen["compile"] == "attention" and seen["max_num_seqs"] == 3 and seen["app"] == "app"
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123
    cli.main(["serve", str(folder), "--compile"])
    assert seen["compile"] is True
    cli.main(["serve", str(folder), "--compile-single"])
    assert seen["compile"] == "single"
    cli.main(["serve", str(folder), "--compile-aot"])
    assert seen["compile"] == "aot"
    cli.main(["serve", str(folder), "--eager"])
    assert seen["compile"] is False
    cli.main(["serve", str(folder)])
    assert seen["compile"] == cli.SERVE_COMPILE  # the mode measured fastest (docs/engine-performance.md)
    with pytest.raises(SystemExit):  # one or the other
        cli.main(["serve", str(folder), "--compile", "--compile-attention"])
    with pytest.raises(SystemExit):
        cli.main(["serve", str(folder), "--compile-single", "--eager"])


def test_the_engine_process_loads_and_unloads_lora_adapters(setup, client, tmp_path: Path) -> None:
    """LoRA adapters over the engine process's pipe (``serving.lora_api``; more in ``test_server_lora``)."""
    model, tok, served = setup
    tuned = copy.deepcopy(model)
    tuned.add_adapter(r=2, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    folder = tuned.save_adapter(tmp_path / "tuned")
    tuned.merge_adapter()
    headers = {"Authorization": f"Bearer {KEY}"}
    loaded = httpx.post(served.url + "/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": str(folder)},
                        headers=headers, timeout=60)
    assert loaded.status_code == 200, loaded.text
    answer = client.chat.completions.create(model="tuned", messages=MESSAGES, temperature=0, max_tokens=8)
    assert answer.model == "tuned" and answer.choices[0].message.content == tok.decode(
        reference(tuned, tok, MESSAGES, 8))
    missing = httpx.post(served.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)},
                         headers=headers, timeout=60)
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "tuned"}, headers=headers,
                      timeout=60).status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
