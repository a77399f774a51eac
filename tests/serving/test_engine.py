"""The engine's correctness contract: a request's tokens do not depend on what else is in the batch.

Every request of a continuous batch (prompts of different lengths joining at different steps, prefill chunked under
a small token budget beside decode rows, blocks of 4 positions so sliding windows of 8 span blocks) gets the tokens
— and the step logits — of ``DecoderLM.generate`` run on it alone; so do seeded samples, prefix-cache hits,
preempted requests and the ``n`` samples of one request.
"""

from __future__ import annotations

import pytest
import torch

from models import DecoderLM
from models.generation.sampling import SamplingParams
from serving import Engine

FAMILIES = ["tiny", "mistral-tiny", "gemma2-tiny", "qwen3-tiny", "gpt_neox-tiny",
            "deepseek_v2-tiny", "deepseek_v3-tiny"]  # latent attention: the paged_latent cache
PROMPT_LENGTHS = (3, 9, 14, 21, 33)
MAX_TOKENS = (12, 20, 7, 15, 10)
SAMPLING = SamplingParams(do_sample=True, temperature=0.9, top_k=50)


def tiny_model(preset: str) -> DecoderLM:
    """A tiny model in fp32 eval mode whose weights are scaled so that greedy outputs vary."""
    torch.manual_seed(0)
    model = DecoderLM.from_preset(preset, dropout=0.0).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, DecoderLM]:
    return {preset: tiny_model(preset) for preset in FAMILIES}


def prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def alone(model: DecoderLM, prompt: list[int], max_tokens: int, **kwargs: object) -> list[int]:
    """``generate`` on the prompt alone, cut after the first EOS (the engine stops there)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, **kwargs)[0, len(prompt):].tolist()
    eos = model.config.eos_token_id
    return out[: out.index(eos) + 1] if eos in out else out


def run_staggered(engine: Engine, arrivals: dict[int, list[tuple[list[int], dict]]]) -> list:
    """Add requests at the given steps, step until every request is done; outputs in order of addition."""
    ids, step = [], 0
    while step <= max(arrivals) or engine.has_unfinished():
        for prompt, kwargs in arrivals.get(step, []):
            ids.append(engine.add_request(prompt, **kwargs))
        engine.step()
        step += 1
    return [engine.pop_output(r) for r in ids]


@pytest.mark.parametrize("preset", FAMILIES)
def test_greedy_continuous_batch_matches_generate_alone(models: dict[str, DecoderLM], preset: str) -> None:
    model = models[preset]
    ps = prompts()
    engine = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    arrivals = {0: [(ps[3], {}), (ps[0], {})], 2: [(ps[1], {})], 5: [(ps[4], {}), (ps[2], {})]}
    order = [3, 0, 1, 4, 2]
    for i, (_, kwargs) in zip(order, [r for step in sorted(arrivals) for r in arrivals[step]], strict=True):
        kwargs.update(max_tokens=MAX_TOKENS[i], logprobs=5)
    outputs = run_staggered(engine, arrivals)
    distinct = set()
    for i, out in zip(order, outputs, strict=True):
        prompt = ps[i]
        want = alone(model, prompt, MAX_TOKENS[i])
        assert out.token_ids == want, (preset, i)
        assert out.finish_reason == ("stop" if want[-1] == model.config.eos_token_id else "length")
        distinct |= set(want)
        # The step logits: each token's log-probability and the top 5, against one full forward pass.
        with torch.no_grad():
            full = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, full[torch.arange(len(want)), torch.tensor(want)], rtol=0, atol=1e-4)
        for lp, row in zip(out.logprobs, full, strict=True):
            top = row.topk(5)
            assert list(lp.top) == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(list(lp.top.values())), top.values, rtol=0, atol=1e-4)
    assert len(distinct) > 10  # the outputs are not one repeated token
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_seeded_sampling_is_the_same_whatever_else_is_in_the_batch(models: dict[str, DecoderLM]) -> None:
    model = models["mistral-tiny"]
    ps = prompts(2)
    crowd = Engine(model, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    arrivals = {
        0: [(ps[4], dict(max_tokens=9)), (ps[1], dict(sampling=SAMPLING, seed=3, max_tokens=14))],
        1: [(ps[2], dict(sampling=SAMPLING, seed=7, max_tokens=12))],
        3: [(ps[0], dict(sampling=SAMPLING, seed=5, max_tokens=8)), (ps[3], dict(max_tokens=6))],
    }
    outputs = run_staggered(crowd, arrivals)
    lone = Engine(model, block_size=8).generate([ps[2]], SAMPLING, seed=7, max_tokens=12)[0]
    want = alone(model, ps[2], 12, sampling=SAMPLING, generator=torch.Generator().manual_seed(7))
    assert outputs[2].token_ids == lone.token_ids == want
    assert outputs[1].token_ids == alone(model, ps[1], 14, sampling=SAMPLING,
                                         generator=torch.Generator().manual_seed(3))


def test_prefix_cache_hit_gives_the_tokens_of_a_miss(models: dict[str, DecoderLM]) -> None:
    model = models["gemma2-tiny"]
    shared = prompts(3)[4][:22]
    tails = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    engine = Engine(model, block_size=4, max_num_batched_tokens=64)
    first = engine.generate([shared + tails[0]], max_tokens=10)[0]
    assert engine.scheduler.prefix_hits == 0 and engine.allocator.num_cached > 0
    second = engine.generate([shared + tails[1], shared + tails[0]], max_tokens=10)
    # 5 full blocks of the shared prefix for the new tail; the whole prompt but its last block for the repeat.
    assert engine.scheduler.prefix_hits == 20 + 24
    assert second[1].token_ids == first.token_ids == alone(model, shared + tails[0], 10)
    assert second[0].token_ids == alone(model, shared + tails[1], 10)
    miss = Engine(model, block_size=4, prefix_caching=False).generate([shared + tails[1]], max_tokens=10)[0]
    assert miss.token_ids == second[0].token_ids


def test_preempted_requests_finish_with_the_tokens_they_would_have_had(models: dict[str, DecoderLM]) -> None:
    model = models["qwen3-tiny"]
    ps = prompts(4)
    engine = Engine(model, block_size=4, num_blocks=14, max_num_batched_tokens=32)  # 56 positions for ~130 wanted
    kinds = [dict(max_tokens=20), dict(sampling=SAMPLING, seed=1, max_tokens=20), dict(max_tokens=18),
             dict(sampling=SAMPLING, seed=2, max_tokens=16)]
    chosen = [ps[2], ps[3], ps[1], ps[0]]
    outputs = run_staggered(engine, {0: list(zip(chosen, kinds, strict=True))})
    assert engine.scheduler.preemptions > 0
    for prompt, kwargs, out in zip(chosen, kinds, outputs, strict=True):
        seed = kwargs.get("seed")
        extra = {} if seed is None else dict(sampling=SAMPLING, generator=torch.Generator().manual_seed(seed))
        assert out.token_ids == alone(model, prompt, kwargs["max_tokens"], **extra)
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_n_samples_share_the_prompt_blocks_differ_and_follow_their_seeds(models: dict[str, DecoderLM]) -> None:
    model = models["tiny"]
    prompt = prompts(5)[3]  # 21 tokens: 5 full blocks of 4 and one partial
    engine = Engine(model, block_size=4)
    request = engine.add_request(prompt, SAMPLING, n=3, seed=11, max_tokens=12)
    while len(engine.requests[request]) == 1:
        engine.step()
    table = engine.requests[request][0].block_table
    assert [engine.allocator.refs[b] for b in table[:5]] == [3] * 5  # the full prompt blocks, shared
    assert engine.allocator.refs[table[5]] == 1  # the partial block is the parent's alone
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(request)
    assert len(out.token_ids) == 3 and len({tuple(t) for t in out.token_ids}) == 3
    for j, tokens in enumerate(out.token_ids):
        assert tokens == alone(model, prompt, 12, sampling=SAMPLING, generator=torch.Generator().manual_seed(11 + j))
    assert engine.allocator.num_free == engine.allocator.n_blocks


def test_a_model_in_train_mode_decodes_in_eval_mode_and_stays_in_train_mode() -> None:
    torch.manual_seed(0)
    model = DecoderLM.from_preset("tiny", dropout=0.5)  # train mode: dropout would change every token
    prompt = prompts(8)[2]
    want = alone(model.eval(), prompt, 8)
    model.train()
    assert Engine(model, block_size=4).generate(prompt, max_tokens=8)[0].token_ids == want
    assert all(m.training for m in model.modules())
