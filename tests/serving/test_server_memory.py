"""``zoo serve`` with the engine in its own process (the default): the server process holds no copy of the weights —
its model sits on the meta device and its resident set does not grow by the weights' size, while
``--no-engine-process`` (the engine in the server's process) holds them once."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import uvicorn

from models import DecoderLM
from serving import cli, openai_api
from serving.bench import resident_memory
from tokenization import train_byte_level_bpe


def test_the_server_process_holds_no_second_copy_of_the_weights(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tok = train_byte_level_bpe(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300, min_frequency=1)
    # Tables over 32 MiB: glibc maps each on its own and unmaps it when freed, so what this test frees is not
    # reused by what it loads next (the resident set tells a load apart).
    model = DecoderLM.from_preset("tiny", vocab_size=20_000, d_model=512, d_ff=512, n_layers=1, dropout=0.0)
    weights = sum(p.nbytes for p in model.parameters())  # ~80 MB
    model.save_pretrained(tmp_path, tokenizer=tok)
    del model
    gc.collect()
    seen: dict = {}
    monkeypatch.setattr(openai_api, "create_app", lambda model, *args, **kwargs: seen.update(kwargs, model=model))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    before = resident_memory()[0]
    cli.main(["serve", str(tmp_path)])
    grown = resident_memory()[0] - before
    server_model = seen["model"]
    assert all(t.is_meta for t in (*server_model.parameters(), *server_model.buffers()))
    assert seen["engine_process"].path == str(tmp_path)  # the engine process loads the weights itself
    assert grown < 0.2 * weights, (grown, weights)
    before = resident_memory()[0]
    cli.main(["serve", str(tmp_path), "--no-engine-process"])  # the reference: one copy, in this process
    float(sum(p.detach().sum() for p in seen["model"].parameters()))  # read once (a mapped file is resident when read)
    assert resident_memory()[0] - before > 0.8 * weights
    assert not any(t.is_meta for t in seen["model"].parameters()) and seen["model"].embed_tokens.weight.dtype == \
        torch.float32
