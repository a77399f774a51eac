"""LoRA adapters over the OpenAI API (``serving.lora_api``): picked by ``model`` with the official ``openai`` client,
listed by ``/v1/models``, loaded and unloaded while serving (vLLM's endpoints), counted in ``/metrics``; one server
(the engine in its own process) for the whole module."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from models import DecoderLM
from serving import Engine
from serving.async_engine import AsyncEngine
from serving.openai_api import create_app
from tests.serving.test_engine_lora import randomize
from tests.serving.test_server import Served, scrape, tokenizer

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the quick brown fox"


def base(vocab: int) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", vocab_size=vocab, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=64,
                                  dropout=0.0, eos_token_id=None)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # a varied greedy text
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    tok = tokenizer()
    root = tmp_path_factory.mktemp("server-loras")
    folders = {}
    for i, (name, r, targets) in enumerate([("r2", 2, ["q_proj", "v_proj"]), ("r8", 8, ["up_proj", "o_proj"])]):
        model = base(len(tok))
        model.add_adapter(r=r, alpha=2 * r, target_modules=targets)
        randomize(model, i)
        folders[name] = model.save_adapter(root / name)
    wide = DecoderLM.from_preset("tiny", vocab_size=len(tok), d_model=16, n_heads=4, n_layers=2, d_ff=64)
    wide.add_adapter(r=2, target_modules=["q_proj"])
    folders["other"] = wide.save_adapter(root / "other")
    served = Served(create_app(base(len(tok)), tok, model_name="tiny", api_key=KEY, max_num_seqs=4,
                               loras={"r2": folders["r2"]}, max_loras=2))
    yield tok, folders, served
    served.stop()


@pytest.fixture(scope="module")
def client(setup) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=setup[2].url + "/v1", api_key=KEY, max_retries=0)


def merged_text(tok, folders: dict[str, Path], name: str | None, max_tokens: int) -> str:  # noqa: ANN001
    """Greedy text of the base model with adapter ``name`` merged into its weights."""
    model = base(len(tok))
    if name is not None:
        model.load_adapter(folders[name])
        model.merge_adapter()
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return tok.decode(ids[len(tok.encode(PROMPT)):])


def complete(client: openai.OpenAI, model: str, max_tokens: int = 8) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0).choices[0].text


def post(setup, path: str, body: dict, headers: dict = AUTH) -> httpx.Response:  # noqa: ANN001, B006
    return httpx.post(setup[2].url + path, json=body, headers=headers, timeout=60)


def test_the_request_model_picks_the_adapter(setup, client) -> None:  # noqa: ANN001
    tok, folders, _ = setup
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny", "r2"} and listed["r2"].parent == "tiny" and listed["r2"].root == str(folders["r2"])
    with_adapter, without = complete(client, "r2"), complete(client, "tiny")
    assert with_adapter == merged_text(tok, folders, "r2", 8) != without == merged_text(tok, folders, None, 8)
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        complete(client, "nope")
    metrics = scrape(setup[2].url)
    assert metrics['zoo_lora_requests_total{adapter="r2"}'] >= 1
    assert metrics['zoo_lora_generation_tokens_total{adapter="r2"}'] >= 8


def test_adapters_load_and_unload_while_a_stream_runs(setup, client) -> None:  # noqa: ANN001
    tok, folders, _ = setup
    stream = client.completions.create(model="r2", prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    first = next(iter(stream))
    loaded = post(setup, "/v1/load_lora_adapter", {"lora_name": "r8", "lora_path": str(folders["r8"])})
    assert loaded.status_code == 200 and "r8" in loaded.text
    assert post(setup, "/v1/unload_lora_adapter", {"lora_name": "r2"}).status_code == 200  # r2 is still streaming
    text = first.choices[0].text + "".join(c.choices[0].text for c in stream)
    assert text == merged_text(tok, folders, "r2", 40)
    assert complete(client, "r8") == merged_text(tok, folders, "r8", 8)
    with pytest.raises(openai.NotFoundError):
        complete(client, "r2")
    assert post(setup, "/v1/load_lora_adapter", {"lora_name": "r2", "lora_path": str(folders["r2"])}).status_code == 200
    assert complete(client, "r2") == merged_text(tok, folders, "r2", 8)


def test_adapters_that_do_not_fit_are_refused_with_400_naming_why(setup, client) -> None:  # noqa: ANN001
    _, folders, _ = setup
    wrong = post(setup, "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(folders["other"])})
    assert wrong.status_code == 400 and "shape" in wrong.json()["error"]["message"]
    missing = post(setup, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(folders["r2"]) + "-x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert post(setup, "/v1/load_lora_adapter", {"lora_name": "r9"}).status_code == 400  # no lora_path
    assert post(setup, "/v1/unload_lora_adapter", {"lora_name": "never"}).status_code == 404
    assert post(setup, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "y"}, headers={}).status_code == 401
    assert "other" not in {m.id for m in client.models.list().data}
    assert complete(client, "tiny")  # the server goes on


def test_the_in_process_engine_loads_and_unloads_between_steps(setup) -> None:  # noqa: ANN001
    tok, folders, _ = setup
    front = AsyncEngine(Engine(base(len(tok)), tok, max_loras=1))

    async def scenario() -> str:
        await front.lora("add", "r8", folders["r8"])
        request = await front.add_request(tok.encode(PROMPT), max_tokens=8, adapter="r8")
        await front.lora("remove", "r8")  # queued already: it runs with r8
        with pytest.raises(ValueError, match="is not loaded"):
            await front.lora("remove", "r8")
        text = "".join([d.text async for d in front.stream(request)])
        await front.close()
        return text

    result = {}
    thread = threading.Thread(target=lambda: result.update(text=asyncio.run(scenario())))
    thread.start()
    thread.join(timeout=60)
    assert result["text"] == merged_text(tok, folders, "r8", 8)


def test_zoo_serve_hands_its_lora_options_to_the_engine(monkeypatch: pytest.MonkeyPatch, setup) -> None:  # noqa: ANN001
    import uvicorn

    from serving import cli, openai_api

    tok, folders, _ = setup
    path = folders["r2"].parent / "base"
    base(len(tok)).save_pretrained(path, tokenizer=tok)
    seen: dict = {}
    monkeypatch.setattr(openai_api, "create_app", lambda *args, **kwargs: seen.update(kwargs) or "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(app=app, **kwargs))
    cli.main(["serve", str(path), "--lora", f"a={folders['r2']}", "--lora", "b=user/repo", "--max-lora-rank", "32"])
    assert seen["loras"] == {"a": str(folders["r2"]), "b": "user/repo"} and seen["max_loras"] == 4
    assert seen["max_lora_rank"] == 32
    cli.main(["serve", str(path)])
    assert seen["loras"] == {} and seen["max_loras"] == 0
    with pytest.raises(SystemExit):
        cli.main(["serve", str(path), "--lora", "no-equals-sign"])
