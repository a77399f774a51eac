"""Perplexity by llama.cpp's method equals a float64 brute force: every scored token's probability from its own
forward pass over the chunk prefix before it, in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import models
from tests.tiny_checkpoint import CORPUS
from training.perplexity import chunk_tokens, perplexity


@pytest.fixture(scope="module")
def model_and_tokens(tiny_llama_dir):
    model = models.from_pretrained(tiny_llama_dir).eval()
    tokens = model.tokenizer.encode(" ".join(CORPUS * 2))
    return model, tokens


def brute_force(model, tokens, n_ctx, bos, chunks) -> float:
    model = copy.deepcopy(model).double()
    nll, count = 0.0, 0
    for c in range(chunks):
        chunk = [bos, *tokens[c * n_ctx + 1:(c + 1) * n_ctx]]
        for j in range(n_ctx // 2 + 1, n_ctx):  # the second half, each token from everything before it
            with torch.no_grad():
                logits = model(torch.tensor([chunk[:j]])).logits[0, -1]
            nll -= logits.log_softmax(-1)[chunk[j]].item()
            count += 1
    return math.exp(nll / count)


@pytest.mark.parametrize(("n_ctx", "batch_size"), [(12, 1), (9, 3)])
def test_perplexity_equals_a_float64_brute_force(model_and_tokens, n_ctx: int, batch_size: int) -> None:
    model, tokens = model_and_tokens
    bos = model.tokenizer.bos_token_id
    seen = []
    result = perplexity(model, tokens, n_ctx, bos_token_id=bos, batch_size=batch_size, progress=False, max_chunks=4,
                        on_chunk=lambda k, ppl: seen.append((k, ppl)))
    assert result.n_chunks == min(4, len(tokens) // n_ctx) == 4
    assert result.n_scored == result.n_chunks * (n_ctx - 1 - n_ctx // 2)
    assert result.perplexity == pytest.approx(brute_force(model, tokens, n_ctx, bos, 4), rel=1e-5)
    assert [k for k, _ in seen] == list(range(1, result.n_chunks + 1))
    assert seen[-1][1] == result.perplexity == result.running[-1]
    assert 0 < result.uncertainty < result.perplexity


def test_chunks_start_with_bos_and_drop_the_tail() -> None:
    chunks = chunk_tokens(list(range(10, 31)), 5, bos_token_id=1)
    assert chunks.tolist() == [[1, 11, 12, 13, 14], [1, 16, 17, 18, 19], [1, 21, 22, 23, 24], [1, 26, 27, 28, 29]]
    assert chunk_tokens(list(range(10, 31)), 5, None, max_chunks=2).tolist() == [[10, 11, 12, 13, 14],
                                                                                [15, 16, 17, 18, 19]]
    with pytest.raises(ValueError, match="needs at least 12"):
        chunk_tokens(list(range(11)), 6, None)
    with pytest.raises(ValueError, match="n_ctx"):
        chunk_tokens(list(range(100)), 2, None)
