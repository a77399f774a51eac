"""Generation: DecoderLM greedy/sampling/streaming, Seq2Seq greedy and beam search, EncoderLM fill-mask."""

from __future__ import annotations

import math

import pytest
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models.generation.steps
from blocks.kv_cache import KVCache
from models import DecoderLM, DecoderLMConfig, EncoderLM, EncoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from models.generation.beam_search import beam_search, gnmt_length_penalty
from models.generation.sampling import SamplingParams, apply_repetition_penalty, top_k_filter, top_p_filter
from tests.models.test_kv_cache import (
    BACKENDS,
    VOCAB,
    build,
    decoder_configs,
    left_padding_masks,
    seq2seq_configs,
)
from tests.strategies import SEEDS, padding_masks, randn, token_ids
from tokenization import Tokenizer

#: A small vocabulary for beam search, so that EOS is often among the candidates of a random model.
SMALL_VOCAB = 12


def tiny_decoder(**overrides: object) -> DecoderLM:
    config = dict(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=32, dropout=0.0)
    return build(DecoderLM, DecoderLMConfig(**{**config, **overrides}), 0)


def tiny_seq2seq(**overrides: object) -> Seq2SeqTransformer:
    config = dict(
        vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, max_len=64,
        dropout=0.0,
    )
    return build(Seq2SeqTransformer, Seq2SeqConfig(**{**config, **overrides}), 0)


def uncached_greedy(model: DecoderLM, ids: torch.Tensor, n: int, penalty: float | None = None) -> torch.Tensor:
    """The reference: a full forward pass over the whole sequence for every new token, then the arg-max."""
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[:, -1]
            if penalty is not None:
                seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
                logits = apply_repetition_penalty(logits, seen, penalty)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def first_eos_cut(new: torch.Tensor, eos: int, pad: int) -> torch.Tensor:
    """What a row should become when it stops at its first ``eos``: everything after it replaced by ``pad``,
    and columns after the last row has stopped dropped."""
    new = new.clone()
    ends = []
    for row in new:
        hits = (row == eos).nonzero().flatten()
        end = int(hits[0]) + 1 if hits.numel() else row.numel()
        row[end:] = pad
        ends.append(end)
    return new[:, : max(ends)]


# ================================================================================================== DecoderLM
@settings(max_examples=15)
@given(config=decoder_configs(fast_on_cpu=True), seed=SEEDS, data=st.data())
def test_greedy_generate_equals_uncached_argmax_loop(config: DecoderLMConfig, seed: int, data: st.DataObject) -> None:
    model = build(DecoderLM, config, seed)
    b, length, n = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    prompt = data.draw(token_ids(VOCAB, b, length))
    out = model.generate(prompt, max_new_tokens=n, eos_token_id=None)
    assert out.dtype == torch.long
    assert torch.equal(out, uncached_greedy(model, prompt, n))


@settings(max_examples=10)
@given(config=decoder_configs(fast_on_cpu=True), seed=SEEDS, data=st.data())
def test_left_padded_batch_equals_each_prompt_alone(config: DecoderLMConfig, seed: int, data: st.DataObject) -> None:
    model = build(DecoderLM, config, seed)
    b, length, n = data.draw(st.integers(2, 3)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 5))
    mask = data.draw(left_padding_masks(b, length))
    ids = data.draw(token_ids(VOCAB, b, length)).masked_fill(~mask, config.pad_token_id)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, eos_token_id=None)
    assert torch.equal(out[:, :length], ids)
    for row in range(b):
        alone = model.generate(ids[row : row + 1, mask[row]], max_new_tokens=n, eos_token_id=None)
        assert torch.equal(out[row, length:], alone[0, int(mask[row].sum()) :])


@settings(max_examples=10)
@given(config=decoder_configs(fast_on_cpu=True), seed=SEEDS, data=st.data())
def test_each_row_stops_at_its_own_eos_and_is_padded(config: DecoderLMConfig, seed: int, data: st.DataObject) -> None:
    model = build(DecoderLM, config, seed)
    b, length, n = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), 8
    prompt = data.draw(token_ids(VOCAB, b, length))
    free = model.generate(prompt, max_new_tokens=n, eos_token_id=None)
    # An EOS id that the first row really produces, so that stopping happens.
    eos = int(free[0, length + data.draw(st.integers(0, n - 1))])
    pad = data.draw(st.sampled_from([0, 1, eos]))
    out = model.generate(prompt, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad)
    expected = first_eos_cut(free[:, length:], eos, pad)
    assert torch.equal(out[:, :length], prompt)
    assert torch.equal(out[:, length:], expected)
    streamed = list(model.stream(prompt, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad))
    assert torch.equal(torch.stack(streamed, dim=1), expected)


def test_eos_and_pad_default_to_the_config() -> None:
    model = tiny_decoder()
    prompt = torch.randint(4, VOCAB, (3, 3))
    free = model.generate(prompt, max_new_tokens=10, eos_token_id=None)
    eos = int(free[1, 5])
    model = tiny_decoder(eos_token_id=eos, pad_token_id=1)
    assert torch.equal(model.generate(prompt, max_new_tokens=10)[:, 3:], first_eos_cut(free[:, 3:], eos, 1))
    # No pad id configured: rows are padded with the EOS id, as for GPT-2.
    model = tiny_decoder(eos_token_id=eos, pad_token_id=None)
    assert torch.equal(model.generate(prompt, max_new_tokens=10)[:, 3:], first_eos_cut(free[:, 3:], eos, eos))


@settings(max_examples=10)
@given(config=decoder_configs(fast_on_cpu=True), seed=SEEDS, data=st.data())
def test_top_k_1_and_tiny_top_p_sampling_equal_greedy(config: DecoderLMConfig, seed: int, data: st.DataObject) -> None:
    model = build(DecoderLM, config, seed)
    prompt = data.draw(token_ids(VOCAB, data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5))))
    greedy = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    gen = torch.Generator().manual_seed(data.draw(SEEDS))
    kwargs = dict(max_new_tokens=6, eos_token_id=None, do_sample=True, temperature=1.7, generator=gen)
    assert torch.equal(model.generate(prompt, top_k=1, **kwargs), greedy)
    assert torch.equal(model.generate(prompt, top_p=1e-6, **kwargs), greedy)


def test_seeded_generator_reproduces_samples_and_stream_matches() -> None:
    model = tiny_decoder()
    prompt = torch.randint(4, VOCAB, (2, 4))
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=30, top_p=0.95, eos_token_id=None)
    first = model.generate(prompt, generator=torch.Generator().manual_seed(7), **kwargs)
    again = model.generate(prompt, generator=torch.Generator().manual_seed(7), **kwargs)
    other = model.generate(prompt, generator=torch.Generator().manual_seed(8), **kwargs)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)  # 32 draws over ~30 tokens each: equal only by a ~1e-40 chance
    streamed = list(model.stream(prompt, generator=torch.Generator().manual_seed(7), **kwargs))
    assert len(streamed) == 16
    assert torch.equal(torch.stack(streamed, dim=1), first[:, 4:])


def test_stream_yields_each_token_before_computing_the_next() -> None:
    model = tiny_decoder()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[1]))
    tokens = model.stream(torch.randint(4, VOCAB, (1, 5)), max_new_tokens=4, eos_token_id=None)
    assert calls == []  # nothing runs before the first token is asked for
    first = next(tokens)
    assert calls == [5] and first.shape == (1,)
    next(tokens)
    assert calls == [5, 1]
    assert len(list(tokens)) == 2 and calls == [5, 1, 1, 1]


def test_repetition_penalty_in_greedy_decoding_matches_the_reference() -> None:
    model = tiny_decoder()
    prompt = torch.randint(4, VOCAB, (2, 4))
    out = model.generate(prompt, max_new_tokens=8, eos_token_id=None, repetition_penalty=1.8)
    assert torch.equal(out, uncached_greedy(model, prompt, 8, penalty=1.8))
    assert not torch.equal(out, model.generate(prompt, max_new_tokens=8, eos_token_id=None))


def test_empty_prompt_starts_from_bos() -> None:
    model = tiny_decoder(bos_token_id=5)
    empty = model.generate(torch.empty(2, 0, dtype=torch.long), max_new_tokens=4, eos_token_id=None)
    assert torch.equal(empty, model.generate(torch.full((2, 1), 5), max_new_tokens=4, eos_token_id=None))
    assert empty.shape == (2, 5) and bool((empty[:, 0] == 5).all())


def test_generate_leaves_training_mode_and_returns_tensors_usable_in_autograd() -> None:
    model = tiny_decoder(dropout=0.5)
    model.train()
    model.layers[0].eval()  # a mixed state is restored exactly
    prompt = torch.randint(4, VOCAB, (2, 3))
    out = model.generate(prompt, max_new_tokens=5, eos_token_id=None)
    # Dropout is off while generating: two runs agree although the model is in training mode.
    assert torch.equal(out, model.generate(prompt, max_new_tokens=5, eos_token_id=None))
    assert model.training and not model.layers[0].training and model.layers[1].training
    assert not out.is_inference()
    model(out, labels=out).loss.backward()  # the output can feed a training step
    assert not next(iter(model.stream(prompt, max_new_tokens=1))).is_inference()


def test_max_new_tokens_zero_returns_the_prompt() -> None:
    model = tiny_decoder()
    prompt = torch.randint(4, VOCAB, (2, 3))
    assert torch.equal(model.generate(prompt, max_new_tokens=0), prompt)
    assert list(model.stream(prompt, max_new_tokens=0)) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(eos_token_id=VOCAB), "eos_token_id"),
        (dict(pad_token_id=-1), "pad_token_id"),
        (dict(generator=3), "generator"),
        (dict(max_new_tokens=30), "max_len=32"),  # learned positions: 4 + 30 > 32
        (dict(attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])), "left"),
        (dict(attention_mask=torch.ones(2, 3)), "attention_mask"),
    ],
)
def test_decoder_bad_input_raises(kwargs: dict, match: str) -> None:
    model = tiny_decoder(positional="learned")
    with pytest.raises(ValueError, match=match):
        model.generate(torch.randint(4, VOCAB, (2, 4)), **kwargs)
    with pytest.raises(ValueError, match=match):
        model.stream(torch.randint(4, VOCAB, (2, 4)), **kwargs)  # checked at the call, not at the first token


def test_decoder_bad_prompts_raise() -> None:
    model = tiny_decoder(bos_token_id=None)
    with pytest.raises(ValueError, match="bos_token_id"):
        model.generate(torch.empty(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate(torch.tensor([[VOCAB]]))
    # Temperature does not matter for greedy decoding, and positions that can extend allow long outputs.
    model.generate(torch.tensor([[5]]), temperature=0.0, max_new_tokens=1)
    tiny_decoder(positional="rotary").generate(torch.tensor([[5]]), max_new_tokens=40, eos_token_id=None)


# ================================================================================================== sampling
@given(seed=SEEDS, b=st.integers(1, 3), vocab=st.integers(2, 30), p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_most_likely_set_reaching_p(seed: int, b: int, vocab: int, p: float) -> None:
    logits = randn((b, vocab), seed, scale=3.0)
    kept = top_p_filter(logits, p) > float("-inf")
    probs = logits.softmax(-1)
    for row in range(b):
        mass = probs[row][kept[row]]
        assert mass.sum() >= p - 1e-5  # enough mass
        assert mass.sum() - mass.min() < p + 1e-5  # and minimal: without its least likely token it falls short
        dropped = probs[row][~kept[row]]
        assert dropped.numel() == 0 or dropped.max() <= mass.min()  # the most likely tokens


@given(seed=SEEDS, vocab=st.integers(1, 30), k=st.integers(1, 40))
def test_top_k_keeps_exactly_the_k_largest(seed: int, vocab: int, k: int) -> None:
    logits = randn((2, vocab), seed)
    kept = top_k_filter(logits, k) > float("-inf")
    assert bool((kept.sum(-1) == min(k, vocab)).all())
    smallest_kept = logits.masked_fill(~kept, float("inf")).min(-1).values
    assert bool((logits.masked_fill(kept, float("-inf")).max(-1).values < smallest_kept).all())


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert torch.equal(apply_repetition_penalty(logits, seen, 2.0), torch.tensor([[1.0, -4.0, 1.0, -1.0]]))


def test_sampling_follows_the_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).expand(4000, -1)
    params = SamplingParams(do_sample=True, top_k=2)
    draws = params.next_tokens(logits, generator=torch.Generator().manual_seed(0))
    assert set(draws.unique().tolist()) == {0, 1}
    assert abs(float((draws == 0).float().mean()) - math.e / (math.e + 1)) < 0.03


# ================================================================================================== Seq2Seq
def uncached_seq2seq_greedy(model: Seq2SeqTransformer, src, src_mask, n: int) -> torch.Tensor:
    tgt = torch.full((src.shape[0], 1), model.config.decoder_start_token_id)
    with torch.no_grad():
        for _ in range(n):
            logits = model(src, tgt, src_mask).logits[:, -1]
            tgt = torch.cat([tgt, logits.argmax(-1, keepdim=True)], dim=1)
    return tgt


def uncached_beam_step(model: Seq2SeqTransformer, src, src_mask):
    """A ``beam_search`` step without caches: the whole target prefix through a full forward pass."""
    state: dict = {"tgt": None, "src": src, "mask": src_mask}

    def step(tokens: torch.Tensor, parents: torch.Tensor | None, sources_changed: bool) -> torch.Tensor:
        if parents is not None:
            state["tgt"] = state["tgt"][parents]
            state["src"] = state["src"][parents]
            state["mask"] = None if state["mask"] is None else state["mask"][parents]
        state["tgt"] = tokens if state["tgt"] is None else torch.cat([state["tgt"], tokens], dim=1)
        with torch.no_grad():
            return model(state["src"], state["tgt"], state["mask"]).logits[:, -1]

    return step


def rescore(model: Seq2SeqTransformer, src, src_mask, out: torch.Tensor, eos: int, alpha: float) -> torch.Tensor:
    """Teacher-forced ``log P(Y|X) / lp(|Y|)`` of outputs ``(B, 1 + T)``; |Y| runs to the first EOS."""
    with torch.no_grad():
        log_probs = model(src, out[:, :-1], src_mask).logits.log_softmax(-1)
    tokens = out[:, 1:]
    chosen = log_probs.gather(-1, tokens[..., None]).squeeze(-1)
    is_eos = (tokens == eos).long()
    counted = (is_eos.cumsum(-1) - is_eos) == 0  # up to and including the first EOS
    return (chosen * counted).sum(-1) / gnmt_length_penalty(counted.sum(-1).float(), alpha)


@settings(max_examples=10)
@given(config=seq2seq_configs(fast_on_cpu=True), seed=SEEDS, data=st.data())
def test_seq2seq_greedy_equals_uncached_argmax_loop(config: Seq2SeqConfig, seed: int, data: st.DataObject) -> None:
    model = build(Seq2SeqTransformer, config, seed)
    b, s, n = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 6))
    src = data.draw(token_ids(VOCAB, b, s))
    src_mask = data.draw(st.one_of(st.none(), padding_masks(b, s)))
    out = model.generate(src, src_mask, max_new_tokens=n, num_beams=1, eos_token_id=None)
    assert torch.equal(out, uncached_seq2seq_greedy(model, src, src_mask, n))


@settings(max_examples=12)
@given(config=seq2seq_configs(vocab_size=SMALL_VOCAB, fast_on_cpu=True), seed=SEEDS, data=st.data())
def test_beam_search_with_cache_equals_uncached_and_beats_greedy(
    config: Seq2SeqConfig, seed: int, data: st.DataObject
) -> None:
    model = build(Seq2SeqTransformer, config, seed)
    b, s = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5))
    src = data.draw(token_ids(SMALL_VOCAB, b, s))
    src_mask = data.draw(st.one_of(st.none(), padding_masks(b, s)))
    beams, alpha = data.draw(st.integers(2, 4)), data.draw(st.sampled_from([0.0, 0.6, 1.0]))
    n, eos, start = data.draw(st.integers(1, 7)), config.eos_token_id, config.decoder_start_token_id
    out, scores = model.generate(src, src_mask, max_new_tokens=n, num_beams=beams, length_penalty=alpha,
                                 return_scores=True)
    assert bool((out[:, 0] == start).all()) and out.shape[1] <= 1 + n

    # The cached search reorders caches exactly as a search that recomputes every prefix.
    reference = beam_search(
        uncached_beam_step(model, src, src_mask), batch_size=b, start_token_id=start, num_beams=beams,
        max_new_tokens=n, eos_token_id=eos, pad_token_id=config.pad_token_id, length_penalty=alpha,
    )
    assert torch.equal(out[:, 1:], reference.sequences)
    torch.testing.assert_close(scores, reference.scores, atol=1e-5, rtol=1e-5)
    # Stopping early never changes the result.
    late = model.generate(src, src_mask, max_new_tokens=n, num_beams=beams, length_penalty=alpha,
                          early_stopping=False)
    assert torch.equal(late, out)

    # The reported scores are the length-normalised log-probabilities, and never below greedy's.
    torch.testing.assert_close(scores, rescore(model, src, src_mask, out, eos, alpha), atol=1e-4, rtol=1e-4)
    greedy = model.generate(src, src_mask, max_new_tokens=n, num_beams=1, length_penalty=alpha)
    assert bool((scores >= rescore(model, src, src_mask, greedy, eos, alpha) - 1e-5).all())


@settings(max_examples=10)
@given(config=seq2seq_configs(vocab_size=SMALL_VOCAB, fast_on_cpu=True), seed=SEEDS, data=st.data())
def test_num_beams_1_is_greedy_and_one_beam_never_scores_below_it(
    config: Seq2SeqConfig, seed: int, data: st.DataObject
) -> None:
    model = build(Seq2SeqTransformer, config, seed)
    b, s, n = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 7))
    src = data.draw(token_ids(SMALL_VOCAB, b, s))
    alpha, eos, pad = data.draw(st.sampled_from([0.0, 0.6])), config.eos_token_id, config.pad_token_id
    greedy, scores = model.generate(src, max_new_tokens=n, num_beams=1, length_penalty=alpha, return_scores=True)
    free = uncached_seq2seq_greedy(model, src, None, n)
    assert torch.equal(greedy[:, 1:], first_eos_cut(free[:, 1:], eos, pad))
    torch.testing.assert_close(scores, rescore(model, src, None, greedy, eos, alpha), atol=1e-4, rtol=1e-4)
    one_beam = beam_search(
        uncached_beam_step(model, src, None), batch_size=b, start_token_id=config.decoder_start_token_id,
        num_beams=1, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad, length_penalty=alpha,
    )
    assert bool((one_beam.scores >= scores - 1e-5).all())


def test_seq2seq_rows_are_padded_after_eos_and_sampling_is_reproducible() -> None:
    model = tiny_seq2seq(vocab_size=SMALL_VOCAB)
    src = torch.randint(4, SMALL_VOCAB, (4, 5))
    out = model.generate(src, max_new_tokens=12, num_beams=3)
    for row in out[:, 1:]:
        hits = (row == model.config.eos_token_id).nonzero().flatten()
        if hits.numel():
            assert bool((row[int(hits[0]) + 1 :] == model.config.pad_token_id).all())
    kwargs = dict(max_new_tokens=8, num_beams=1, do_sample=True, top_k=5)
    first = model.generate(src, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(first, model.generate(src, generator=torch.Generator().manual_seed(3), **kwargs))
    start_5 = model.generate(src, max_new_tokens=3, num_beams=2, decoder_start_token_id=5)
    assert bool((start_5[:, 0] == 5).all())


def test_seq2seq_default_length_is_source_length_plus_50() -> None:
    model = tiny_seq2seq(positional="sinusoidal")
    src = torch.randint(4, VOCAB, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    assert model.generate(src, mask, num_beams=2, eos_token_id=None).shape == (2, 1 + 4 + 50)
    # Learned positions cap the default at what they can represent; an explicit length beyond it is an error.
    learned = tiny_seq2seq(positional="learned", max_len=20)
    assert learned.generate(src, num_beams=1, eos_token_id=None).shape == (2, 20)
    with pytest.raises(ValueError, match="max_len=20"):
        learned.generate(src, max_new_tokens=20)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_beams=0), "num_beams"),
        (dict(num_beams=-2), "num_beams"),
        (dict(num_beams=2.5), "num_beams"),
        (dict(num_beams=4, do_sample=True), "num_beams=1"),
        (dict(num_beams=4, repetition_penalty=1.2), "num_beams=1"),
        (dict(num_beams=1, do_sample=True, temperature=0), "temperature"),
        (dict(num_beams=1, top_p=1.01), "top_p"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(decoder_start_token_id=None), "decoder_start_token_id"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(src_mask=torch.ones(2, 2, dtype=torch.bool)), "src_mask"),
    ],
)
def test_seq2seq_bad_input_raises(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_seq2seq().generate(torch.randint(4, VOCAB, (2, 5)), **kwargs)


def test_seq2seq_empty_source_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny_seq2seq().generate(torch.empty(1, 0, dtype=torch.long))


@pytest.mark.parametrize("backend", BACKENDS)
def test_generation_runs_on_every_backend(backend: str) -> None:
    # The hypothesis tests above skip backends that are slow on CPU; the cache itself is checked against a
    # full forward for every backend in test_kv_cache.py. This runs each search end to end once per backend.
    decoder = tiny_decoder(attention_backend=backend, positional="rotary", n_layers=1)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    ids = torch.randint(4, VOCAB, (2, 3)).masked_fill(~mask, 0)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert torch.equal(out[1:], uncached_greedy(decoder, ids[1:], 3))
    assert torch.equal(out[0, 3:], uncached_greedy(decoder, ids[:1, 1:], 3)[0, 2:])
    model = tiny_seq2seq(attention_backend=backend, vocab_size=SMALL_VOCAB)
    src = torch.randint(4, SMALL_VOCAB, (2, 4))
    found = model.generate(src, max_new_tokens=3, num_beams=2)
    reference = beam_search(
        uncached_beam_step(model, src, None), batch_size=2, start_token_id=model.config.decoder_start_token_id,
        num_beams=2, max_new_tokens=3, eos_token_id=model.config.eos_token_id, pad_token_id=0, length_penalty=0.6,
    )
    assert torch.equal(found[:, 1:], reference.sequences)


# -------------------------------------------------------------------------------------------------- copy task
PAD, BOS, EOS, FIRST_SYMBOL, COPY_VOCAB = 0, 2, 3, 4, 12


def copy_batch(n: int, gen: torch.Generator, min_len: int = 3, max_len: int = 6):
    """Random symbol strings; the target is the source followed by EOS (right-padded, with masks)."""
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    width = int(lengths.max())
    src_mask = torch.arange(width)[None] < lengths[:, None]
    src = torch.randint(FIRST_SYMBOL, COPY_VOCAB, (n, width), generator=gen).masked_fill(~src_mask, PAD)
    tgt_in = torch.cat([torch.full((n, 1), BOS), src], dim=1)
    tgt_mask = torch.arange(width + 1)[None] <= lengths[:, None]
    labels = torch.cat([src.masked_fill(~src_mask, -100), torch.full((n, 1), -100)], dim=1)
    labels[torch.arange(n), lengths] = EOS
    return src, src_mask, tgt_in, tgt_mask, labels, lengths


def test_trained_copy_model_decodes_held_out_inputs_exactly_with_beam_search() -> None:
    torch.manual_seed(0)
    config = Seq2SeqConfig(
        vocab_size=COPY_VOCAB, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
        dropout=0.0, max_len=32, positional="sinusoidal", pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    model = Seq2SeqTransformer(config)
    steps = 300
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
    # Short linear warm-up then linear decay, so the last steps settle instead of bouncing.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 30) * (1 - i / steps))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        src, src_mask, tgt_in, tgt_mask, labels, _ = copy_batch(64, gen)
        loss = model(src, tgt_in, src_mask, tgt_mask, labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()

    src, src_mask, *_, lengths = copy_batch(32, torch.Generator().manual_seed(1234))
    out = model.generate(src, src_mask, num_beams=4)
    # Every output stopped at its EOS, far before the default limit of source length + 50.
    assert out.shape[1] == int(lengths.max()) + 2
    for row in range(32):
        n = int(lengths[row])
        assert out[row, : n + 2].tolist() == [BOS, *src[row, :n].tolist(), EOS]
        assert bool((out[row, n + 2 :] == PAD).all())


# ================================================================================================== fill-mask
MASK_ID = 4


def tiny_encoder(**overrides: object) -> EncoderLM:
    config = dict(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=32, dropout=0.0,
                  mask_token_id=MASK_ID)
    return build(EncoderLM, EncoderLMConfig(**{**config, **overrides}), 0)


@given(seed=SEEDS, data=st.data())
def test_fill_mask_returns_the_top_k_of_the_model_distribution(seed: int, data: st.DataObject) -> None:
    model = tiny_encoder()
    b, length, top_k = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8)), data.draw(st.integers(1, VOCAB))
    ids = data.draw(token_ids(VOCAB, b, length)).masked_fill(randn((b, length), seed) > 0.5, MASK_ID)
    ids[0, data.draw(st.integers(0, length - 1))] = MASK_ID
    mask = data.draw(st.one_of(st.none(), padding_masks(b, length)))
    if mask is not None:
        mask[0, (ids[0] == MASK_ID).nonzero()[0]] = True  # at least one mask at a real position
    result = model.fill_mask(ids, top_k=top_k, attention_mask=mask)
    expected_positions = ((ids == MASK_ID) & (True if mask is None else mask)).nonzero()
    n = expected_positions.shape[0]
    assert torch.equal(result.positions, expected_positions)
    assert result.token_ids.shape == result.probs.shape == (n, top_k)
    assert bool((result.probs[:, :-1] >= result.probs[:, 1:]).all())
    assert bool((result.probs.sum(-1) <= 1 + 1e-5).all()) and bool((result.probs >= 0).all())
    with torch.no_grad():
        probs = model(ids, attention_mask=mask).logits.softmax(-1)[result.positions[:, 0], result.positions[:, 1]]
    torch.testing.assert_close(result.probs, probs.gather(1, result.token_ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.probs, probs.topk(top_k).values, atol=1e-5, rtol=1e-5)


def word_tokenizer(words: list[str]) -> Tokenizer:
    """A word-level ``tokenization.Tokenizer`` built in memory; special tokens first, so ``[MASK]`` is 4."""
    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]"]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    return Tokenizer(backend)


def test_fill_mask_text_through_an_attached_tokenizer() -> None:
    tokenizer = word_tokenizer("the cat dog sat ran on a mat rug".split())
    assert tokenizer.mask_token_id == MASK_ID
    model = tiny_encoder(vocab_size=tokenizer.vocab_size, mask_token_id=None)
    with pytest.raises(ValueError, match="tokenizer"):
        model.fill_mask_text("the cat [MASK] on the mat")
    model.tokenizer = tokenizer
    results = model.fill_mask_text("the [MASK] sat on the [MASK]", top_k=3)
    ids = tokenizer.encode("the [MASK] sat on the [MASK]")
    tensor_result = model.fill_mask(torch.tensor([ids]), tokenizer.mask_token_id, top_k=3)
    assert len(results) == 2 and all(len(candidates) == 3 for candidates in results)
    for candidates, ids_k, probs in zip(results, tensor_result.token_ids, tensor_result.probs, strict=True):
        assert [c["token_id"] for c in candidates] == ids_k.tolist()
        assert [c["score"] for c in candidates] == pytest.approx(probs.tolist())
        assert [c["token"] for c in candidates] == [tokenizer.decode([i]) for i in ids_k.tolist()]
    filled = list(ids)
    filled[1] = results[0][0]["token_id"]
    assert results[0][0]["sequence"] == tokenizer.decode(filled)
    with pytest.raises(ValueError, match="no mask token"):
        model.fill_mask_text("the cat sat")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(top_k=0), "top_k"),
        (dict(top_k=VOCAB + 1), "top_k"),
        (dict(mask_token_id=VOCAB), "mask_token_id"),
        (dict(mask_token_id=7), "no mask token"),
    ],
)
def test_fill_mask_bad_input_raises(kwargs: dict, match: str) -> None:
    ids = torch.tensor([[5, MASK_ID, 6]])
    with pytest.raises(ValueError, match=match):
        tiny_encoder().fill_mask(ids, **kwargs)


def test_fill_mask_without_a_mask_id_raises() -> None:
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_encoder(mask_token_id=None).fill_mask(torch.tensor([[5, MASK_ID]]))


# ================================================================================================== hostile sizes
@pytest.fixture
def cache_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``max_len`` of every KV cache created while the test runs (initial and grown ones)."""
    sizes: list[int] = []
    init = KVCache.__init__

    def recording_init(self: KVCache, max_len: int) -> None:
        sizes.append(max_len)
        init(self, max_len)

    monkeypatch.setattr(KVCache, "__init__", recording_init)
    return sizes


def test_huge_max_new_tokens_allocates_only_what_is_generated(cache_sizes: list[int]) -> None:
    # Rotary positions put no bound on the length; EOS comes at the first step, so nothing beyond one chunk of
    # cache may be allocated (the old code preallocated prompt + 10**9 positions per layer, ~256 GB).
    model = tiny_decoder(positional="rotary")
    # Then two left-padded copies of a prompt: both rows stop at once, on the masked path.
    padded, mask = torch.tensor([[0, 8, 9]] * 2), torch.tensor([[0, 1, 1]] * 2, dtype=torch.bool)
    for ids, m in ((torch.tensor([[7, 8, 9]]), None), (padded, mask)):
        first = model.generate(ids, attention_mask=m, max_new_tokens=1, eos_token_id=None)[:, -1]
        eos = int(first[0])
        cache_sizes.clear()
        out = model.generate(ids, attention_mask=m, max_new_tokens=10**9, eos_token_id=eos)
        assert torch.equal(out[:, -1], first) and out.shape[1] == ids.shape[1] + 1
        assert cache_sizes and max(cache_sizes) <= ids.shape[1] + models.generation.steps.CACHE_CHUNK
        stream = model.stream(ids, attention_mask=m, max_new_tokens=10**9, eos_token_id=eos)
        assert torch.equal(torch.stack(list(stream), dim=1)[:, 0], first)

    # Seq2Seq: greedy and beam search. EOS is made certain at every step through the output bias.
    seq2seq = tiny_seq2seq(positional="sinusoidal", output_bias=True)
    with torch.no_grad():
        seq2seq.lm_head.bias[seq2seq.config.eos_token_id] = 50.0
    calls: list[int] = []
    seq2seq.lm_head.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    src = torch.randint(5, VOCAB, (2, 4))
    for beams in (1, 3):
        cache_sizes.clear()
        calls.clear()
        out = seq2seq.generate(src, max_new_tokens=10**9, num_beams=beams)
        assert out.tolist() == [[seq2seq.config.decoder_start_token_id, seq2seq.config.eos_token_id]] * 2
        assert len(calls) == 1  # one decoding step: every beam ended, nothing can beat the finished hypothesis
        assert cache_sizes and max(cache_sizes) <= models.generation.steps.CACHE_CHUNK


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_caches_that_grow_in_chunks_give_the_same_tokens(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(models.generation.steps, "CACHE_CHUNK", chunk)
    model = tiny_decoder(positional="rotary")
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    ids = torch.randint(4, VOCAB, (2, 4)).masked_fill(~mask, 0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=11, eos_token_id=None)
    assert torch.equal(out[1:], uncached_greedy(model, ids[1:], 11))
    assert torch.equal(out[0, 4:], uncached_greedy(model, ids[:1, 2:], 11)[0, 2:])
    seq2seq = tiny_seq2seq(vocab_size=SMALL_VOCAB)
    src = torch.randint(4, SMALL_VOCAB, (3, 4))
    greedy = seq2seq.generate(src, max_new_tokens=9, num_beams=1, eos_token_id=None)
    assert torch.equal(greedy, uncached_seq2seq_greedy(seq2seq, src, None, 9))
    found = seq2seq.generate(src, max_new_tokens=9, num_beams=3, length_penalty=0.6)
    reference = beam_search(
        uncached_beam_step(seq2seq, src, None), batch_size=3, start_token_id=seq2seq.config.decoder_start_token_id,
        num_beams=3, max_new_tokens=9, eos_token_id=seq2seq.config.eos_token_id, pad_token_id=0, length_penalty=0.6,
    )
    assert torch.equal(found[:, 1:], reference.sequences)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_seq2seq_max_new_tokens_zero_returns_the_start_token(num_beams: int) -> None:
    model = tiny_seq2seq()
    src = torch.randint(4, VOCAB, (2, 5))
    out, scores = model.generate(src, max_new_tokens=0, num_beams=num_beams, return_scores=True)
    assert out.tolist() == [[model.config.decoder_start_token_id]] * 2
    assert scores.tolist() == [0.0, 0.0]  # log P of the empty continuation
    assert model.generate(src, max_new_tokens=0, num_beams=num_beams).shape == (2, 1)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_vanishing_temperature_samples_the_arg_max(temperature: float) -> None:
    # Raw logits over 1e-40 overflow to inf in float32 and the softmax gives NaN ("probability tensor contains
    # inf/nan"); the limit of temperature -> 0 is greedy decoding.
    model = tiny_decoder()
    prompt = torch.randint(4, VOCAB, (3, 4))
    greedy = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    sampled = model.generate(prompt, max_new_tokens=6, eos_token_id=None, do_sample=True, temperature=temperature,
                             top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, greedy)
    logits = torch.tensor([[3.0, -1e4, 2.0, 3.0 - 1e-3]])
    params = SamplingParams(do_sample=True, temperature=temperature)
    draws = params.next_tokens(logits.expand(50, -1), generator=torch.Generator().manual_seed(0))
    assert draws.tolist() == [0] * 50
    # Two exactly tied maxima share the mass, as they do at any temperature.
    tied = SamplingParams(do_sample=True, temperature=temperature).next_tokens(
        torch.tensor([[1.0, 5.0, 5.0, -2.0]]).expand(400, -1), generator=torch.Generator().manual_seed(0))
    assert set(tied.tolist()) == {1, 2} and 150 < int((tied == 1).sum()) < 250


def test_interleaved_streams_leave_the_training_flags_as_they_were() -> None:
    model = tiny_decoder(dropout=0.5)
    model.train()
    model.layers[0].eval()  # a mixed state must come back exactly
    flags = [m.training for m in model.modules()]
    prompt = torch.randint(4, VOCAB, (2, 3))
    expected = model.generate(prompt, max_new_tokens=4, eos_token_id=None)[:, 3:]
    first = model.stream(prompt, max_new_tokens=4, eos_token_id=None)
    second = model.stream(prompt, max_new_tokens=4, eos_token_id=None)
    got_first, got_second = [next(first)], [next(second)]
    # Between tokens the model is as the caller left it (a training step here would use dropout).
    assert [m.training for m in model.modules()] == flags
    got_first += list(first)  # the first stream ends while the second is still open
    assert [m.training for m in model.modules()] == flags
    got_second += list(second)
    assert [m.training for m in model.modules()] == flags
    # Every step still ran in eval mode: dropout 0.5 would change the tokens.
    assert torch.equal(torch.stack(got_first, 1), expected) and torch.equal(torch.stack(got_second, 1), expected)
    # An abandoned stream changes nothing either.
    third = model.stream(prompt, max_new_tokens=4, eos_token_id=None)
    next(third)
    third.close()
    assert [m.training for m in model.modules()] == flags
