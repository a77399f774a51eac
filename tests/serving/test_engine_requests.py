"""Engine requests: stop ids and strings, max_tokens and the context, per-prompt arguments, bad input, cancellation
without leaks, the bounded queue and the async API."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from models import DecoderLM, Seq2SeqTransformer
from models.generation.sampling import SamplingParams
from serving import AsyncEngine, Engine, QueueFullError

from .test_engine import SAMPLING, alone, prompts, tiny_model


class CharTokenizer:
    """One printable character per token id (enough to test stop strings and text deltas)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 30 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(30 + i) if 3 <= i < 97 else "~" for i in ids)


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    return tiny_model("llama-tiny")


@pytest.fixture(scope="module")
def reference(model: DecoderLM) -> tuple[list[int], list[int]]:
    prompt = prompts(7)[2]
    return prompt, alone(model, prompt, 24)


def test_stop_token_ids_and_max_tokens(model: DecoderLM, reference: tuple[list[int], list[int]]) -> None:
    prompt, want = reference
    stop_id = want[5]
    cut = want.index(stop_id) + 1
    engine = Engine(model, block_size=4)
    by_id, by_length = engine.generate([prompt, prompt], stop=[[stop_id], None], max_tokens=[24, 4])
    assert by_id.token_ids == want[:cut] and by_id.finish_reason == "stop"  # the stop token is kept
    assert by_length.token_ids == want[:4] and by_length.finish_reason == "length"
    # The context ends a sample too: max_model_len counts prompt + output.
    short = Engine(model, block_size=4, max_model_len=len(prompt) + 3).generate(prompt, max_tokens=24)[0]
    assert short.token_ids == want[:3] and short.finish_reason == "length"


def test_stop_strings_cut_the_text_and_stream_nothing_past_them(
    model: DecoderLM, reference: tuple[list[int], list[int]]
) -> None:
    prompt, want = reference
    tok = CharTokenizer()
    text = tok.decode(want)
    stop = text[6:8]
    start = text.find(stop)
    engine = Engine(model, tok, block_size=4)
    request = engine.add_request(prompt, max_tokens=24, stop=stop)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    out = engine.pop_output(request)
    assert out.text == text[:start] and out.finish_reason == "stop"
    assert out.token_ids == want[: start + len(stop)]  # up to the token that completed the stop string
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    # String prompts go through the tokenizer.
    as_text = engine.generate(tok.decode(prompt), max_tokens=5)[0]
    assert as_text.prompt_token_ids == tok.encode(tok.decode(prompt)) and len(as_text.token_ids) == 5


def test_per_prompt_arguments_and_repetition_penalty(model: DecoderLM) -> None:
    ps = prompts(8)[:3]
    penalised = SamplingParams(repetition_penalty=1.5)
    outs = Engine(model, block_size=4).generate(ps, [None, penalised, SAMPLING], max_tokens=[3, 9, 6],
                                                seed=[None, None, 4])
    assert [len(o.token_ids) for o in outs] == [3, 9, 6]
    assert outs[1].token_ids == alone(model, ps[1], 9, repetition_penalty=1.5)
    assert outs[2].token_ids == alone(model, ps[2], 6, sampling=SAMPLING, generator=torch.Generator().manual_seed(4))


def test_presence_and_frequency_penalties_count_each_samples_own_output(model: DecoderLM) -> None:
    ps = prompts(9)[:3]
    greedy = SamplingParams(presence_penalty=1.2, frequency_penalty=0.8)
    sampled = SamplingParams(do_sample=True, temperature=0.9, frequency_penalty=2.0)
    engine = Engine(model, block_size=4)
    outs = engine.generate(ps, [greedy, sampled, None], max_tokens=[10, 8, 6], seed=[None, 5, None])
    assert outs[0].token_ids == alone(model, ps[0], 10, sampling=greedy)
    assert outs[0].token_ids != alone(model, ps[0], 10)  # the penalties change the answer
    assert outs[1].token_ids == alone(model, ps[1], 8, sampling=sampled, generator=torch.Generator().manual_seed(5))
    assert outs[2].token_ids == alone(model, ps[2], 6)
    # n > 1: every sample counts its own tokens (a shared count would change the later samples' draws).
    two = engine.generate(ps[1], sampled, max_tokens=8, n=2, seed=5)[0]
    assert two.token_ids[0] == outs[1].token_ids
    assert two.token_ids[1] == alone(model, ps[1], 8, sampling=sampled, generator=torch.Generator().manual_seed(6))


def test_kv_cache_bytes_sizes_the_pool_by_the_bytes_its_blocks_take(model: DecoderLM) -> None:
    c = model.config
    # One block of 4 positions, counted by hand: keys and values, every layer, float32.
    per_block = c.n_layers * 2 * c.n_kv_heads * 4 * c.d_head * 4
    engine = Engine(model, block_size=4, kv_cache_bytes=10 * per_block + per_block // 2)
    assert engine.allocator.n_blocks == 10
    prompt = prompts(3)[1]
    assert engine.generate(prompt, max_tokens=5)[0].token_ids == alone(model, prompt, 5)
    assert engine.runner.block_nbytes() == per_block  # measured on the pools the engine allocated
    with pytest.raises(ValueError, match=f"kv_cache_bytes={per_block - 1} holds no block"):
        Engine(model, block_size=4, kv_cache_bytes=per_block - 1)
    with pytest.raises(ValueError, match="not both"):
        Engine(model, block_size=4, kv_cache_bytes=per_block, num_blocks=3)
    with pytest.raises(ValueError, match="kv_cache_bytes must be a positive integer, got 1.5"):
        Engine(model, block_size=4, kv_cache_bytes=1.5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompts=[[]]), "empty prompt"),
        (dict(prompts=[[5, 1000]]), "1000 is outside the vocabulary"),
        (dict(prompts=[[-1]]), "-1 is outside the vocabulary"),
        (dict(prompts=[[5] * 256]), "longer than the context"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (dict(max_tokens=[4, -2]), "prompt 1: max_tokens must be an integer >= 1, got -2"),
        (dict(n=0), "n must be an integer >= 1, got 0"),
        (dict(n=2), "n=2 samples need sampling"),
        (dict(max_tokens=[1, 2, 3]), "max_tokens has 3 values for 2 prompts"),
        (dict(prompts=["abc"]), "no tokenizer"),
        (dict(stop="x"), "needs a tokenizer"),
        (dict(stop=[1000]), "stop item 1000"),
        (dict(logprobs=-1), "logprobs must be None"),
        (dict(seed=1.5), "seed must be an integer"),
    ],
)
def test_bad_requests_raise_value_error_before_anything_runs(model: DecoderLM, kwargs: dict, match: str) -> None:
    engine = Engine(model, block_size=4)
    args = {"prompts": [[5, 6], [7]], **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.generate(args.pop("prompts"), **args)
    assert not engine.has_unfinished() and not engine.requests


def test_a_cache_too_small_for_one_request_and_bad_limits_raise(model: DecoderLM) -> None:
    engine = Engine(model, block_size=4, num_blocks=3)  # 12 positions
    with pytest.raises(ValueError, match="cache is too small for this request: it needs 14 positions"):
        engine.generate([list(range(3, 13))], max_tokens=5)
    assert engine.generate([list(range(3, 10))], max_tokens=5)[0].finish_reason in ("stop", "length")
    for limit in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
        with pytest.raises(ValueError, match=f"{limit} must be a positive integer, got 0"):
            Engine(model, **{limit: 0})
    with pytest.raises(NotImplementedError, match="Seq2SeqTransformer"):
        Engine(Seq2SeqTransformer.from_preset("tiny"))


def test_waiting_queue_is_bounded(model: DecoderLM) -> None:
    engine = Engine(model, block_size=4, max_waiting=2)
    engine.add_request([5, 6])
    engine.add_request([7, 8])
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        engine.add_request([9])
    engine.step()  # both join the running batch: room in the queue again
    engine.add_request([9])
    with pytest.raises(ValueError, match="in use"):
        engine.add_request([9], request_id="req-0")


def test_no_block_leaks_after_many_requests_with_cancellations(model: DecoderLM) -> None:
    rng = random.Random(0)
    engine = Engine(model, block_size=4, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=24)
    shared = prompts(9)[4][:12]  # a common prefix, so the prefix cache holds blocks
    live: list[str] = []
    for step in range(400):
        if step < 150 and rng.random() < 0.4:
            tail = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 20))]
            prompt = (shared if rng.random() < 0.5 else []) + tail
            n = rng.choice([1, 1, 2])
            live.append(engine.add_request(prompt, SAMPLING if n > 1 else None, n=n, seed=step,
                                           max_tokens=rng.randrange(1, 16)))
        if live and rng.random() < 0.15:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
        if step >= 150 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    alloc = engine.allocator
    assert engine.scheduler.preemptions > 0 and engine.scheduler.prefix_hits > 0
    assert alloc.refs == [0] * alloc.n_blocks and alloc.num_free == alloc.n_blocks
    assert alloc.num_cached == len(alloc.cached_free_blocks()) > 0  # the prefix cache holds only free blocks
    assert not engine.abort("no-such-request")


def test_async_api_streams_deltas_and_aborts(model: DecoderLM, reference: tuple[list[int], list[int]]) -> None:
    prompt, want = reference
    other = prompts(10)[1]

    async def main() -> tuple[list, list, list]:
        front = AsyncEngine(Engine(model, block_size=4))
        first = await front.add_request(prompt, max_tokens=24)
        second = await front.add_request(other, max_tokens=40)
        third = await front.add_request(other, SAMPLING, n=2, seed=3, max_tokens=40)
        with pytest.raises(ValueError, match="empty prompt"):
            await front.add_request([])
        got_first = [d async for d in front.stream(first)]
        got_second = []
        async for delta in front.stream(second):
            got_second.append(delta)
            if len(got_second) == 3:
                front.abort(second)
        front.abort(third)
        got_third = [d async for d in front.stream(third)]
        await front.close()
        engine = front.engine
        assert not engine.has_unfinished() and not engine.requests
        assert engine.allocator.num_free == engine.allocator.n_blocks
        return got_first, got_second, got_third

    got_first, got_second, got_third = asyncio.run(main())
    assert [t for d in got_first for t in d.token_ids] == want
    assert got_first[-1].finish_reason in ("stop", "length") and all(d.finish_reason is None for d in got_first[:-1])
    assert got_second[-1].finish_reason == "abort" and len(got_second) < 40
    assert sorted(d.index for d in got_third if d.finish_reason is not None) == [0, 1]


def test_a_slow_reader_gets_the_queued_deltas_of_a_sample_joined(model: DecoderLM,
                                                                 reference: tuple[list[int], list[int]]) -> None:
    prompt, want = reference

    async def main() -> list:
        front = AsyncEngine(Engine(model, block_size=4))
        request = await front.add_request(prompt, max_tokens=24, logprobs=1)
        while front.engine.has_unfinished() or front._ops:  # the reader is away until every token is computed
            await asyncio.sleep(0.01)
        got = [d async for d in front.stream(request)]
        await front.close()
        return got

    got = asyncio.run(main())
    assert len(got) == 1  # 24 steps' deltas, one event
    assert got[0].token_ids == want and got[0].finish_reason in ("stop", "length")
    assert [e.token_id for e in got[0].logprobs] == want


def test_nan_logits_end_only_their_request_with_error_and_leave_no_trace() -> None:
    poisoned = tiny_model("llama-tiny")
    with torch.no_grad():
        poisoned.embed_tokens.weight[7] = float("nan")  # any prompt holding token 7 has NaN logits
    ps = prompts(11)
    bad = [7, *ps[0][:20]]  # 21 tokens: five full blocks of 4, committed to the prefix cache
    clean = [ps[1], ps[2], ps[3]]
    want = [alone(poisoned, p, 12) for p in clean]
    assert all(7 not in w for w in want)
    engine = Engine(poisoned, block_size=4)
    ids = [engine.add_request(p, max_tokens=12) for p in (bad, clean[0], clean[1])]  # bad holds block 0
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [d.finish_reason for d in deltas if d.request_id == ids[0]] == ["error"]
    outs = [engine.pop_output(r) for r in ids]
    assert outs[0].finish_reason == "error" and outs[0].token_ids == []
    assert outs[1].token_ids == want[0] and outs[2].token_ids == want[1]  # the batch's other rows are unaffected
    # Its blocks were zeroed and dropped from the prefix cache: a new request reusing them is unaffected, and the
    # same prompt again is computed again (no hit on what the failed request wrote).
    alloc = engine.allocator
    assert alloc.num_free == alloc.n_blocks and alloc.refs == [0] * alloc.n_blocks
    assert engine.generate(clean[2], max_tokens=12)[0].token_ids == want[2]
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\]: its next-token logits are NaN"):
        engine.generate([clean[0], bad], max_tokens=4)
    alone_engine = Engine(poisoned, block_size=4)
    with pytest.raises(ValueError, match=r"prompt\(s\) \[0\]: its next-token logits are NaN"):
        alone_engine.generate([bad], max_tokens=4)
    assert alone_engine.allocator.num_cached == 0  # nothing it wrote can be hit
