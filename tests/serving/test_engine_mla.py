"""The engine on latent-attention families (DeepSeek-V2/V3): a paged cache of latents and rotary keys
(``blocks.paged_latent_cache``) — prefix-cache hits, its block size in bytes and compiled decode steps. (Greedy tokens
of a mixed continuous batch are checked with the other families in ``test_engine``.)"""

from __future__ import annotations

import pytest
import torch

from models import DecoderLM
from models.generation import compiled
from serving import Engine
from serving.engine import kv_block_nbytes

from .test_engine import MAX_TOKENS, alone, prompts, run_staggered, tiny_model


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    return tiny_model("deepseek_v2-tiny")


def test_prefix_cache_hit_gives_the_tokens_of_a_miss(model: DecoderLM) -> None:
    shared = prompts(3)[4][:33]
    tails = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    engine = Engine(model, block_size=4, max_num_batched_tokens=64)
    assert not model.layers[0].self_attn.absorbs(36)  # the first prompt's one chunk expands its latents
    first = engine.generate([shared + tails[0]], max_tokens=10)[0]
    second = engine.generate([shared + tails[1], shared + tails[0]], max_tokens=10)
    assert engine.scheduler.prefix_hits == 32 + 32  # 8 full blocks each
    assert second[1].token_ids == first.token_ids == alone(model, shared + tails[0], 10)
    assert second[0].token_ids == alone(model, shared + tails[1], 10)
    miss = Engine(model, block_size=4, prefix_caching=False).generate([shared + tails[1]], max_tokens=10)[0]
    assert miss.token_ids == second[0].token_ids
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_a_block_holds_latents_and_rotary_keys_only(model: DecoderLM) -> None:
    attn = model.layers[0].self_attn
    per_block = model.config.n_layers * 4 * (attn.kv_lora_rank + attn.d_rope) * 4  # 2 · 4 · (32 + 8) · 4 bytes
    assert kv_block_nbytes(model, 4) == per_block == 1280
    engine = Engine(model, block_size=4, kv_cache_bytes=12 * per_block + 7)
    assert engine.allocator.n_blocks == 12
    prompt = prompts(6)[2]
    assert engine.generate(prompt, max_tokens=6)[0].token_ids == alone(model, prompt, 6)
    assert engine.runner.block_nbytes() == per_block  # measured on the pools the engine allocated


def test_compiled_decode_steps_give_the_tokens_of_generate_alone(model: DecoderLM,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, num_blocks=64, compile=True)
    assert engine.runner.nbytes == 0  # the pools grow with the blocks in use, compiled steps too
    calls = []

    def counting(step):  # noqa: ANN001, ANN202
        def counted(*args):  # noqa: ANN002, ANN202
            calls.append(args[1].shape[1])
            return step(*args)
        return counted

    engine.runner.step, engine.runner.single = counting(engine.runner.step), counting(engine.runner.single)
    arrivals = {0: [(ps[0], dict(max_tokens=MAX_TOKENS[0]))], 2: [(ps[1], dict(max_tokens=MAX_TOKENS[1]))]}
    outputs = run_staggered(engine, arrivals)
    for i, out in zip([0, 1], outputs, strict=True):
        assert out.token_ids == alone(model, ps[i], MAX_TOKENS[i])
    assert len(set(calls)) == 2  # decode-only steps of one row (the single-row graph) and two rows (the batched)
    assert 0 < engine.runner.nbytes < 64 * kv_block_nbytes(model, 4)
    assert engine.allocator.num_free == engine.allocator.n_blocks
