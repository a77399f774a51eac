"""The engine's paged attention with attention sinks (gpt-oss): continuous batching gives ``generate``'s tokens."""

from __future__ import annotations

import pytest
import torch

from models import DecoderLM
from serving import Engine

from .test_engine import MAX_TOKENS, alone, prompts, run_staggered

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see tests/conftest.py


def test_greedy_continuous_batch_with_sinks_and_windows_matches_generate_alone() -> None:
    torch.manual_seed(0)
    model = DecoderLM.from_preset("gpt_oss-tiny").eval()  # GQA, sinks, a window of 8 on layer 0, MoE
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
        for layer in model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    arrivals = {0: [(ps[3], dict(max_tokens=MAX_TOKENS[3])), (ps[0], dict(max_tokens=MAX_TOKENS[0]))],
                2: [(ps[1], dict(max_tokens=MAX_TOKENS[1]))]}
    outputs = run_staggered(engine, arrivals)
    for i, out in zip([3, 0, 1], outputs, strict=True):
        assert out.token_ids == alone(model, ps[i], MAX_TOKENS[i])
    assert len({t for out in outputs for t in out.token_ids}) > 5
