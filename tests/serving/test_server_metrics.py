"""What the server reports about itself: ``/metrics`` time to first token against what an ``openai`` client
measures (a long prompt, then a prefix-cache hit of it), usage of ``/v1/embeddings`` without the padding of
``tokenizer.json``, ``/tokenize`` and ``/detokenize`` against the tokenizer, the start-up line."""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import httpx
import openai
import pytest
import torch

from models import DecoderLM, EncoderLM
from serving.engine_process import ModelSource
from serving.openai_api import create_app
from serving.startup import startup_line
from tokenization import Tokenizer, train_byte_level_bpe

from .test_server import Served, scrape

FORWARD_S = 1.5  # each forward of the engine's model sleeps this long: time to first token is mostly model time
PROMPT_TOKENS = 700  # two prefill chunks of the engine's 512-token steps


def slowed(build: Any, seconds: float) -> Any:
    """``build()``'s model, each forward made ``seconds`` longer (picklable for the engine process)."""
    model = build()
    model.embed_tokens.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
    return model


def tokenizer(padded: bool = False) -> Tokenizer:
    corpus = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today?"] * 4
    tok = train_byte_level_bpe(corpus, vocab_size=300, min_frequency=1)
    if padded:  # as sentence-transformers' tokenizer.json files are: every text padded to 128 tokens
        tok.backend.enable_padding(pad_id=tok.pad_token_id, pad_token="[PAD]", length=128)
    return tok


@pytest.fixture(scope="module")
def slow_server() -> Any:
    tok = tokenizer()
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=len(tok), d_model=32, n_heads=4, n_layers=1, d_ff=64,
                                  max_len=1024, dropout=0.0).eval()
    source = ModelSource(factory=functools.partial(slowed, ModelSource.from_model(model).factory, FORWARD_S))
    served = Served(create_app(model, tok, model_name="slow", max_num_seqs=2, engine_process=source))
    yield served
    served.stop()


def test_time_to_first_token_is_what_the_client_measures(slow_server) -> None:
    client = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="unused", max_retries=0)
    # The engine process has loaded the model before the port opened (the application's start-up waits for it).
    prompt = [5 + i % 250 for i in range(PROMPT_TOKENS)]
    measured = []
    for _ in ("long prompt", "prefix-cache hit"):
        before = scrape(slow_server.url)
        start = time.perf_counter()
        stream = client.completions.create(model="slow", prompt=prompt, max_tokens=1, temperature=0, stream=True)
        first = next(iter(stream))
        client_ttft = time.perf_counter() - start
        assert first.choices[0].text is not None
        list(stream)
        after = scrape(slow_server.url)
        server_ttft = (after["zoo_time_to_first_token_seconds_sum"] - before["zoo_time_to_first_token_seconds_sum"])
        assert after["zoo_time_to_first_token_seconds_count"] - before["zoo_time_to_first_token_seconds_count"] == 1
        queue = after["zoo_request_queue_time_seconds_sum"] - before["zoo_request_queue_time_seconds_sum"]
        assert 0 <= queue <= server_ttft
        measured.append((client_ttft, server_ttft, after["zoo_prefix_cache_hit_rate"]))
    for client_ttft, server_ttft, _ in measured:
        assert 0.9 * client_ttft <= server_ttft <= client_ttft, measured
    (long_client, _, _), (hit_client, hit_server, hit_rate) = measured
    assert long_client >= 2 * FORWARD_S and hit_server >= FORWARD_S  # two prefill steps, then one
    assert hit_rate > 0.4  # the second prompt came from the cache


def test_tokenize_and_detokenize_in_vllms_shapes(slow_server) -> None:
    tok = tokenizer()
    with httpx.Client(base_url=slow_server.url, timeout=60) as http:
        got = http.post("/tokenize", json={"model": "slow", "prompt": "hello there"}).json()
        assert got == {"count": len(tok.encode("hello there")), "max_model_len": 1024,
                       "tokens": tok.encode("hello there")}
        back = http.post("/detokenize", json={"model": "slow", "tokens": got["tokens"]}).json()
        assert back == {"prompt": tok.decode(got["tokens"], skip_special_tokens=False)}
        bad = http.post("/detokenize", json={"model": "slow", "tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        both = http.post("/tokenize", json={"model": "slow", "prompt": "a", "messages": []})
        assert both.status_code == 400
        other = http.post("/tokenize", json={"model": "other", "prompt": "a"})
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"


def test_embedding_usage_counts_the_tokens_embedded_not_the_padding() -> None:
    tok = tokenizer(padded=True)
    assert len(tok.encode("hello there")) == 128  # what was counted before
    torch.manual_seed(0)
    model = EncoderLM.from_preset("tiny", vocab_size=len(tok), d_model=32, n_heads=4, n_layers=1, d_ff=64,
                                  head="embedding", options={"head": {"pooling": "mean"}}).eval()
    model.tokenizer = tok
    real = sum(sum(tok.backend.encode(t).attention_mask) for t in ("hello there", "the quick brown fox"))
    served = Served(create_app(model, tok, model_name="e"))
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model="e", input=["hello there", "the quick brown fox"])
        assert got.usage.prompt_tokens == real < 2 * 128
    finally:
        served.stop()


def test_the_startup_line_names_what_the_engine_is_given() -> None:
    model = DecoderLM.from_preset("tiny", vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=256)
    args = argparse.Namespace(model="./my-model", device=None)
    limits = dict(max_num_seqs=4, num_blocks=None, block_size=16, kv_cache_bytes=None, max_model_len=128,
                  compile=False)
    # 2 layers x (keys + values) x 16 positions x 32 widths x 4 bytes = 8 KiB per block; 4 x 128/16 blocks.
    line = startup_line("my-model", model, args, limits)
    assert line == (f"serving 'my-model' from ./my-model: dtype float32 on cpu, context 128 tokens, KV cache 32 "
                    f"blocks of 16 positions (0.2 MiB), 4 sequences at most, {torch.get_num_threads()} threads, "
                    "compile off")
