"""Sampling cannot fail for any parameter ``SamplingParams`` accepts: a top-p or a temperature that underflows float32,
a repetition penalty that overflows it, logits at ``±inf`` or the float32 extremes — the step chooses a token that
the distribution allows (one of the ``+inf`` logits when there are any), never raises inside ``torch.multinomial``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.generation.sampling import SamplingParams, apply_repetition_penalty, top_p_filter
from tests.strategies import extreme_logits, sampling_settings


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_a_top_p_that_underflows_float32_keeps_the_most_likely_token(top_p: float) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=top_p)  # the request, as accepted
    kept = top_p_filter(logits, top_p) > float("-inf")
    assert kept.sum(dim=-1).tolist() == [1] * 6  # the nucleus is the single most likely token
    got = params.next_tokens(logits, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got, logits.argmax(dim=-1))


def test_an_extreme_repetition_penalty_leaves_no_nan() -> None:
    logits = torch.tensor([[0.0, 2.0, -3.0, float("-inf"), float("inf")]])
    seen = torch.ones_like(logits, dtype=torch.bool)
    for penalty in (1e300, 1e-300):
        out = apply_repetition_penalty(logits, seen, penalty)
        assert not torch.isnan(out).any()
        assert out[0, 0] == 0 and out[0, 3] == float("-inf") and out[0, 4] == float("inf")
    assert apply_repetition_penalty(logits, seen, 1e300)[0, 2] == torch.finfo(torch.float32).min  # pushed down


@settings(max_examples=30, deadline=None)
@given(settings_=sampling_settings(), data=st.data(), b=st.integers(1, 4), v=st.integers(2, 40))
def test_any_valid_parameters_on_any_logits_choose_an_allowed_token(settings_: dict, data: st.DataObject, b: int,
                                                                   v: int) -> None:
    params = SamplingParams(**settings_)
    logits = data.draw(extreme_logits(b, v))
    seen = torch.rand(b, v, generator=torch.Generator().manual_seed(v)) < 0.5
    counts = seen.long() * 3
    tokens = params.next_tokens(logits, seen, torch.Generator().manual_seed(b), counts)
    assert tokens.shape == (b,) and tokens.dtype == torch.long
    chosen = logits.gather(1, tokens[:, None])[:, 0]
    assert (chosen > float("-inf")).all()  # never a token the logits rule out
    has_inf = (logits == float("inf")).any(dim=-1)
    assert (chosen[has_inf] == float("inf")).all()  # a +inf logit takes the whole mass
    probs = params.probabilities(logits, seen, counts)
    assert not torch.isnan(probs).any() and torch.allclose(probs.sum(-1), torch.ones(b))


def test_rows_with_nothing_to_choose_from_do_not_raise() -> None:
    rows = torch.tensor([[float("-inf")] * 5, [float("nan")] * 5, [0.0, 1.0, float("nan"), 2.0, 3.0]])
    for params in (SamplingParams(do_sample=True), SamplingParams(do_sample=True, top_p=1e-300, temperature=1e-300)):
        tokens = params.next_tokens(rows)  # greedy's choice for them (NaN rows are refused before, by the callers)
        assert torch.equal(tokens, rows.argmax(dim=-1))
