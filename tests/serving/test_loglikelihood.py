"""``continuation_logprobs`` (each shared context run once, continuations batched after it from a KV cache) equals a
brute force that scores every request alone with one plain forward pass: groups of answers sharing a context,
groups larger than the batch, one-token answers, contexts cut to the window; on the zoo's attention variants."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models import DecoderLM
from serving.loglikelihood import continuation_logprobs


@pytest.fixture(scope="module", params=["rotary", "sliding-window"])
def model(request) -> DecoderLM:
    torch.manual_seed(0)
    options = {"options": {"attention": {"window": 5}}} if request.param == "sliding-window" else {}
    lm = DecoderLM.from_preset("tiny", vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=64,
                               dropout=0.0, **options)
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(4.0)
    return lm.eval()


def brute_force(model: DecoderLM, context: list[int], continuation: list[int], window: int) -> tuple[float, bool]:
    whole = (context + continuation)[-(window + 1):]
    with torch.no_grad():
        logp = model(torch.tensor([whole[:-1]])).logits[0].double().log_softmax(-1)  # (L, V)
    n = len(continuation)
    rows = logp[-n:]
    target = torch.tensor(continuation)
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), batch_size=st.integers(1, 7), window=st.sampled_from([12, 64]))
def test_equals_scoring_each_request_alone(model, seed: int, batch_size: int, window: int) -> None:
    rng = random.Random(seed)
    pairs = []
    for _ in range(rng.randint(1, 5)):  # questions, each with several answers sharing its context
        context = [rng.randrange(50) for _ in range(rng.randint(1, 14))]
        pairs += [(context, [rng.randrange(50) for _ in range(rng.randint(1, 6))]) for _ in range(rng.randint(1, 5))]
    # The greedy answer to the first question: its flag must come out True.
    with torch.no_grad():
        greedy = int(model(torch.tensor([pairs[0][0][-window:]])).logits[0, -1].argmax())
    pairs.append((pairs[0][0], [greedy]))
    rng.shuffle(pairs)
    got = continuation_logprobs(model, pairs, batch_size=batch_size, max_length=window)
    for (context, continuation), (logp, is_greedy) in zip(pairs, got, strict=True):
        want, want_greedy = brute_force(model, context, continuation, window)
        assert logp == pytest.approx(want, abs=1e-4)
        assert is_greedy == want_greedy
    assert any(flag for _, flag in got)


def test_bad_requests_are_refused(model) -> None:
    with pytest.raises(ValueError, match="empty context"):
        continuation_logprobs(model, [([], [1, 2])])
    with pytest.raises(ValueError, match="continuation of 0 tokens"):
        continuation_logprobs(model, [([1], [])])
    with pytest.raises(ValueError, match="continuation of 5 tokens"):
        continuation_logprobs(model, [([1], [1] * 5)], max_length=4)
