"""``echo`` with prompt ``logprobs`` on ``/v1/completions``: lm-eval's ``local-completions`` backend against a zoo
server (engine in its own process, as ``zoo serve`` runs it) gives lm-eval's ``hf`` backend's per-sample
log-likelihoods, greedy flags and accuracy on the same checkpoint; the legacy ``logprobs`` shape, checked against
``transformers``' own log-softmax, through both engine fronts."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

from tests.serving.test_lm_eval_model import DOCS, per_sample, write_tasks


def serve(tiny_llama_dir, engine_process: bool) -> Iterator[str]:
    import models
    from serving.openai_api import create_app

    model = models.from_pretrained(str(tiny_llama_dir))
    # A LoRA slot: prompts are scored with the slots routing no token.
    app = create_app(model, model.tokenizer, model_name="tiny", engine_process=engine_process, max_loras=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture(scope="module")
def process_url(tiny_llama_dir) -> Iterator[str]:
    """A server whose engine runs in its own process (``zoo serve``'s default)."""
    yield from serve(tiny_llama_dir, True)


@pytest.fixture(scope="module")
def thread_url(tiny_llama_dir) -> Iterator[str]:
    """A server whose engine is stepped by a thread of the server's process."""
    yield from serve(tiny_llama_dir, False)


@pytest.fixture(params=["process_url", "thread_url"])
def url(request) -> str:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """transformers' model and tokenizer of the checkpoint."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_llama_dir)).eval(), AutoTokenizer.from_pretrained(
        str(tiny_llama_dir))


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)


def test_local_completions_equals_the_hf_backend(process_url, tiny_llama_dir, tmp_path) -> None:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    # Several prompts per request (batch_size=3): scored by one forward pass on the server.
    api = LocalCompletionsAPI(base_url=process_url + "/v1/completions", model="tiny", tokenizer_backend="huggingface",
                              tokenizer=str(tiny_llama_dir), add_bos_token=True, batch_size=3, num_concurrent=1,
                              max_length=256, max_retries=1)
    hf = HFLM(pretrained=str(tiny_llama_dir), batch_size=3, device="cpu", dtype="float32")
    results = {name: lm_eval.simple_evaluate(model=lm, tasks=["zoo_mc"], task_manager=manager, log_samples=True,
                                             random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                             fewshot_random_seed=0, bootstrap_iters=0)
               for name, lm in [("api", api), ("hf", hf)]}
    ours, theirs = per_sample(results["api"], "zoo_mc"), per_sample(results["hf"], "zoo_mc")
    assert len(ours) == len(theirs) == len(DOCS["zoo_mc"])
    for (doc, mine), (_, ref) in zip(ours, theirs, strict=True):
        for a, b in zip(mine, ref, strict=True):
            (logp, greedy), (ref_logp, ref_greedy) = a[0], b[0]
            assert logp == pytest.approx(ref_logp, abs=1e-4), doc
            assert greedy == ref_greedy, doc
    for metric in ("acc,none", "acc_norm,none"):
        assert results["api"]["results"]["zoo_mc"][metric] == results["hf"]["results"]["zoo_mc"][metric], metric


def test_echo_returns_the_prompt_logprobs_in_the_legacy_shape(url, reference) -> None:
    model, tok = reference
    prompt = "The quick brown fox jumps"
    ids = tok(prompt).input_ids  # BOS first, as the zoo's tokenizer encodes it
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (L, V)
    answer = complete(url, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert lp["token_logprobs"][1:] == pytest.approx(want.tolist(), abs=1e-4)
    for top, row in zip(lp["top_logprobs"][1:], logp[:-1], strict=True):
        best = row.topk(3)
        expected: dict[str, float] = {}  # keyed by text: ids that decode alike (bytes of one character) keep the max
        for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            expected[tok.decode([t])] = max(v, expected.get(tok.decode([t]), v))
        assert top == pytest.approx(expected, abs=1e-4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert answer.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}

    # max_tokens=1, greedy (what lm-eval sends): the prompt's entries, then the generated token, the argmax.
    # Token-id prompts of different lengths in one request are scored as each alone.
    short = ids[:4]
    both = complete(url, prompt=[ids, short], echo=True, logprobs=1, max_tokens=1, temperature=0).json()["choices"]
    one = complete(url, prompt=[short], echo=True, logprobs=1, max_tokens=1, temperature=0).json()["choices"][0]
    first = both[0]["logprobs"]
    assert len(first["tokens"]) == len(ids) + 1
    assert first["token_logprobs"][1:-1] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)
    assert first["tokens"][-1] == tok.decode([int(logp[-1].argmax())])
    assert first["token_logprobs"][-1] == pytest.approx(float(logp[-1].max()), abs=1e-4)
    assert both[1]["logprobs"]["token_logprobs"] == pytest.approx(one["logprobs"]["token_logprobs"], abs=1e-6)
    assert both[1]["text"].startswith(tok.decode(short))

    # Streaming: the first chunk starts with the prompt; the offsets run on across chunks.
    with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "echo": True,
                                                              "logprobs": 0, "max_tokens": 3, "stream": True,
                                                              "temperature": 0}, timeout=60) as events:
        chunks = [line[6:] for line in events.iter_lines() if line.startswith("data: ")]
    parts = [json.loads(c)["choices"][0] for c in chunks[:-1]]
    assert parts[0]["text"].startswith(prompt)
    offsets = [o for p in parts for o in p["logprobs"]["text_offset"]]
    tokens = [t for p in parts for t in p["logprobs"]["tokens"]]
    assert len(tokens) == len(ids) + 3
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize(("body", "param"), [({"max_tokens": 0}, "max_tokens"),
                                             ({"echo": True, "logprobs": 1, "prompt": [[0, 10**6]]}, "prompt")])
def test_bad_echo_requests_are_400s(url, body, param: str) -> None:
    answer = complete(url, **{"prompt": "Paris", **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
