"""OpenAI's presence and frequency penalties: the formula, greedy decoding against an uncached reference loop that
counts the generated tokens itself, validation, and the decoding modes that refuse them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from models.generation.sampling import SamplingParams, apply_presence_frequency_penalty

VOCAB = 40
PENALTY = st.floats(-2.0, 2.0, allow_nan=False)


def tiny_decoder() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=64, dropout=0.0)
    model = DecoderLM(config).eval()
    with torch.no_grad():  # scaled so that plain greedy outputs vary rather than repeat one token
        for p in model.parameters():
            p.mul_(3.0)
    return model


@settings(max_examples=30, deadline=None)
@given(presence=PENALTY, frequency=PENALTY, seed=st.integers(0, 2**16), b=st.integers(1, 3), v=st.integers(1, 12))
def test_penalty_is_openais_formula_element_by_element(presence: float, frequency: float, seed: int, b: int,
                                                       v: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g)
    counts = torch.randint(0, 4, (b, v), generator=g)
    got = apply_presence_frequency_penalty(logits, counts, presence, frequency)
    for i in range(b):
        for j in range(v):  # https://platform.openai.com/docs/advanced-usage, "frequency and presence penalties"
            c = int(counts[i, j])
            want = float(logits[i, j]) - c * frequency - (1.0 if c > 0 else 0.0) * presence
            assert float(got[i, j]) == pytest.approx(want, abs=1e-5)


def penalised_greedy(model: DecoderLM, prompt: torch.Tensor, n: int, presence: float, frequency: float) -> list[int]:
    """The reference: a full forward pass per token; counts taken from the generated tokens only."""
    ids = prompt[0].tolist()
    start = len(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
            generated = ids[start:]
            scores = [x - generated.count(j) * frequency - (presence if j in generated else 0.0)
                      for j, x in enumerate(logits)]
            ids.append(max(range(VOCAB), key=scores.__getitem__))
    return ids[start:]


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 2.0), (0.7, 0.9), (-1.0, -0.5)])
def test_greedy_generate_applies_the_penalties_to_generated_tokens(presence: float, frequency: float) -> None:
    model = tiny_decoder()
    prompt = torch.tensor([[5, 9, 5, 17, 3]])
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    out = model.generate(prompt, max_new_tokens=12, eos_token_id=None, sampling=params)[0, 5:].tolist()
    assert out == penalised_greedy(model, prompt, 12, presence, frequency)
    plain = model.generate(prompt, max_new_tokens=12, eos_token_id=None)[0, 5:].tolist()
    assert len(set(plain)) > 3 and out != plain  # the penalties change what this model says
    streamed = [int(t) for t in model.stream(prompt, max_new_tokens=12, eos_token_id=None, sampling=params)]
    assert streamed == out


def test_prompt_tokens_are_not_penalised() -> None:
    # The first token is chosen before anything is generated: whatever the prompt holds, it is plain greedy's.
    model = tiny_decoder()
    prompt = torch.tensor([[7, 7, 7, 7]])
    first = model.generate(prompt, max_new_tokens=1, eos_token_id=None,
                           sampling=SamplingParams(presence_penalty=2.0, frequency_penalty=2.0))
    assert torch.equal(first, model.generate(prompt, max_new_tokens=1, eos_token_id=None))


@pytest.mark.parametrize(("field", "value"), [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                              ("presence_penalty", float("nan")), ("frequency_penalty", True),
                                              ("presence_penalty", "1")])
def test_bad_penalties_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a number in \\[-2, 2\\]"):
        SamplingParams(**{field: value})


def test_beam_search_and_speculative_decoding_refuse_the_penalties() -> None:
    params = SamplingParams(frequency_penalty=0.5)
    seq2seq = Seq2SeqTransformer(Seq2SeqConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                               n_decoder_layers=1, max_len=32, dropout=0.0))
    with pytest.raises(ValueError, match="frequency_penalty=0.5"):
        seq2seq.generate(torch.tensor([[5, 6, 7]]), num_beams=2, sampling=params)
    model = tiny_decoder()
    with pytest.raises(ValueError, match="speculative decoding does not support presence_penalty"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, sampling=params, draft_model=tiny_decoder())
