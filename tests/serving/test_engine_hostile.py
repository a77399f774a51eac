"""One request can never fail another: in one continuous batch, a request with extreme but valid sampling settings
(the issue's ``top_p=1e-300``) or one whose own sampling step fails ends on its own — the others finish with the
tokens they get alone; seeds at the ends of int64 and configs whose context is absurd (2**24 positions, the most a
config may claim) are served or refused by name; the model's own tokenizer is the engine's default."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import DecoderLM
from models.core.config import MAX_POSITIONS
from models.generation.sampling import SamplingParams
from serving import Engine
from serving.cache_size import CPU_SHARE, host_memory
from serving.engine import kv_block_nbytes

from .test_engine import SAMPLING, alone, prompts, tiny_model
from .test_engine_requests import CharTokenizer


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    return tiny_model("llama-tiny")


class ExplodingSampling(SamplingParams):
    """Valid settings whose token choice raises (what a bug in one row's sampling path would do)."""

    def next_tokens(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("sampler exploded")


def innocents(model: DecoderLM) -> tuple[list[list[int]], list[dict], list[list[int]]]:
    """Three requests (greedy, seeded sampling, greedy) and the tokens each gets alone."""
    ps = prompts(5)
    kwargs = [dict(max_tokens=12), dict(sampling=SAMPLING, seed=11, max_tokens=10), dict(max_tokens=9)]
    want = [alone(model, ps[0], 12), alone(model, ps[1], 10, sampling=SAMPLING,
                                           generator=torch.Generator().manual_seed(11)), alone(model, ps[2], 9)]
    return ps[:3], kwargs, want


def run(engine: Engine, requests: list[tuple[list[int], dict]]) -> list:
    ids = [engine.add_request(p, **kw) for p, kw in requests]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_output(r) for r in ids]


def test_a_top_p_that_underflows_is_greedy_and_the_batch_finishes_as_alone(model: DecoderLM) -> None:
    ps, kwargs, want = innocents(model)
    hostile = SamplingParams(do_sample=True, temperature=1.0, top_p=1e-300)  # the request
    engine = Engine(model, block_size=4)
    outs = run(engine, [(ps[0], kwargs[0]), (ps[0], dict(sampling=hostile, max_tokens=8)),
                        (ps[1], kwargs[1]), (ps[2], kwargs[2])])
    assert [o.token_ids for o in (outs[0], outs[2], outs[3])] == want
    assert outs[1].token_ids == alone(model, ps[0], 8)  # a nucleus of one token: greedy decoding
    assert outs[1].finish_reason in ("stop", "length")


def test_a_failing_sampling_step_fails_only_its_request(model: DecoderLM) -> None:
    ps, kwargs, want = innocents(model)
    engine = Engine(model, block_size=4)
    bad = ExplodingSampling(do_sample=True)
    outs = run(engine, [(ps[0], kwargs[0]), (ps[1], dict(sampling=bad, n=2, seed=3, max_tokens=6)),
                        (ps[1], kwargs[1]), (ps[2], kwargs[2])])
    assert [o.token_ids for o in (outs[0], outs[2], outs[3])] == want
    assert outs[1].finish_reason == ["error", "error"] and outs[1].token_ids == [[], []]
    alloc = engine.allocator
    assert alloc.num_free == alloc.n_blocks and alloc.refs == [0] * alloc.n_blocks  # nothing leaked
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\]: choosing its next token failed: RuntimeError: "
                                         r"sampler exploded"):
        engine.generate([ps[0], ps[2]], [None, bad], max_tokens=4)
    assert engine.generate(ps[2], max_tokens=9)[0].token_ids == want[2]  # and the engine goes on


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), -1])
def test_seeds_at_the_ends_of_int64_sample_n_without_overflow(model: DecoderLM, seed: int) -> None:
    engine = Engine(model, block_size=4)
    out = engine.generate(prompts(2)[0], SAMPLING, max_tokens=3, n=3, seed=seed)[0]
    assert out.finish_reason == ["length"] * 3


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64, 10**30])
def test_seeds_beyond_int64_are_refused_by_name(model: DecoderLM, seed: int) -> None:
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*63\)"):
        Engine(model).add_request([5, 6], SAMPLING, seed=seed)


def test_an_absurd_context_gets_a_cache_the_machine_holds_and_bad_sizes_are_refused(model: DecoderLM) -> None:
    # A config may claim at most MAX_POSITIONS (2**24, models.core.config: 1e12 is refused when the config is read);
    # 16 full contexts of that would take 128 GiB of this model's KV cache.
    huge = DecoderLM(dataclasses.replace(model.config, max_len=MAX_POSITIONS)).eval()
    huge.load_state_dict(model.state_dict())
    engine = Engine(huge, block_size=16)
    available, _ = host_memory()
    assert engine.allocator.n_blocks * kv_block_nbytes(huge, 16) <= CPU_SHARE * available * 1.01
    assert engine.allocator.n_blocks * 16 < engine.scheduler.max_num_seqs * MAX_POSITIONS  # not max_num_seqs contexts
    assert engine.context == min(MAX_POSITIONS, engine.allocator.n_blocks * 16)  # at most what the cache holds
    assert engine.generate(prompts(3)[0], max_tokens=5)[0].token_ids == alone(model, prompts(3)[0], 5)
    with pytest.raises(ValueError, match=r"num_blocks=1000000000000000 of 16 positions would take \d+ bytes"):
        Engine(huge, num_blocks=10**15)


def test_the_models_own_tokenizer_is_the_default(model: DecoderLM) -> None:
    carrier = tiny_model("llama-tiny")
    carrier.tokenizer = CharTokenizer()
    out = Engine(carrier).generate("hello", max_tokens=4)[0]  # a string prompt without tokenizer= again
    assert out.prompt_token_ids == CharTokenizer().encode("hello")
    assert out.token_ids == alone(model, CharTokenizer().encode("hello"), 4)
