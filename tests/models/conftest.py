"""Fixtures shared by the compiled-decoding tests (decoder, seq2seq, speculative)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import models.generation.compiled as compiled
from blocks.kv_cache import BucketKVCache


@pytest.fixture
def graph_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dynamo's graph capture and guards are what decide recompilation; "aot_eager" runs the same captured graph
    # without inductor's C++ build (which takes ~15 s even for a tiny model on one core).
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def bucket_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every compiled bucket cache created while the test runs."""
    sizes: list[int] = []
    init = BucketKVCache.__init__

    def recording_init(self: BucketKVCache, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        sizes.append(k.shape[2])
        init(self, k, v, index)

    monkeypatch.setattr(BucketKVCache, "__init__", recording_init)
    return sizes
