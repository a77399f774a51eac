"""``Seq2SeqTransformer.stream``: the tokens of ``generate(..., num_beams=1)`` one step at a time, eager and compiled.

References: an uncached arg-max loop (a full forward pass per token, ``tests.models.test_generation``) for greedy
decoding, ``generate`` with the same seeded generator for sampling, the eager stream for the compiled one.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import models.generation.compiled as compiled
import models.generation.seq2seq_compiled as s2s_compiled
from models.generation.sampling import SamplingParams
from tests.models.test_compiled_seq2seq import EOS, seq2seq, sources
from tests.models.test_generation import first_eos_cut, uncached_seq2seq_greedy

PAD = 0


def stacked(tokens: list[torch.Tensor]) -> torch.Tensor:
    """The streamed ``(B,)`` tokens as ``(B, T)``."""
    assert all(t.shape == tokens[0].shape and t.dtype == torch.long for t in tokens)
    return torch.stack(tokens, dim=1)


def test_greedy_stream_stops_at_eos_pads_and_equals_generate_on_a_padded_batch() -> None:
    # EOS bias 9: rows 0-2 of these sources (1 left-, 2 right-padded) end at different steps, row 3 never does.
    model = seq2seq(eos_bias=9.0)
    src, mask = sources(6, 64, 0)
    kwargs = dict(max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD)
    for rows in (4, 3):  # without row 3 every row ends, and the stream stops when the last one does
        streamed = stacked(list(model.stream(src[:rows], mask[:rows], **kwargs)))
        expected = first_eos_cut(uncached_seq2seq_greedy(model, src[:rows], mask[:rows], 20)[:, 1:], EOS, PAD)
        assert torch.equal(streamed, expected)
        assert torch.equal(streamed, model.generate(src[:rows], mask[:rows], num_beams=1, **kwargs)[:, 1:])
        ended = (streamed == EOS).any(dim=1)
        first_eos = (streamed == EOS).long().argmax(dim=1)[:3]
        assert ended.tolist()[:3] == [True] * 3 and first_eos.min() < first_eos.max(), streamed
        assert bool((streamed[1:3, 1:] == PAD).all())  # padded after their EOS while row 0 went on
    assert streamed.shape[1] == int(first_eos.max()) + 1 < 20


def test_default_length_and_no_eos_run_like_generate() -> None:
    # No EOS: every row runs to the default max_new_tokens, the longest real source length + 50 (paper §6.1).
    model = seq2seq(d_model=16, n_heads=2, n_decoder_layers=1)
    src, mask = sources(5, 64, 1)  # rows of 5, 3 and 2 real tokens: the longest has 5
    streamed = stacked(list(model.stream(src, mask, eos_token_id=None)))
    assert streamed.shape == (4, 55)
    assert torch.equal(streamed, model.generate(src, mask, num_beams=1, eos_token_id=None)[:, 1:])
    assert list(model.stream(src, mask, max_new_tokens=0)) == []
    # The start token decides the first step: another start id gives what generate gives with it.
    kwargs = dict(max_new_tokens=6, eos_token_id=None, decoder_start_token_id=9)
    assert torch.equal(stacked(list(model.stream(src, mask, **kwargs))),
                       model.generate(src, mask, num_beams=1, **kwargs)[:, 1:])


def test_seeded_sampling_stream_equals_generate() -> None:
    model = seq2seq()
    src, mask = sources(7, 64, 2)
    settings = dict(do_sample=True, temperature=1.3, top_k=20, top_p=0.95, repetition_penalty=1.2)
    kwargs = dict(max_new_tokens=16, eos_token_id=EOS)

    def seed(n: int) -> torch.Generator:
        return torch.Generator().manual_seed(n)

    expected = model.generate(src, mask, num_beams=1, generator=seed(5), **settings, **kwargs)[:, 1:]
    assert torch.equal(stacked(list(model.stream(src, mask, generator=seed(5), **settings, **kwargs))), expected)
    as_object = model.stream(src, mask, generator=seed(5), sampling=SamplingParams(**settings), **kwargs)
    assert torch.equal(stacked(list(as_object)), expected)
    # The draws come from the generator: another seed gives other tokens (64 draws from ~20 tokens each).
    other = stacked(list(model.stream(src, mask, generator=seed(6), **settings, **kwargs)))
    assert other.shape != expected.shape or not torch.equal(other, expected)


def test_stream_computes_each_step_when_asked_and_returns_ordinary_tensors() -> None:
    model = seq2seq()
    calls: list[str] = []
    model.encoder_layers[0].register_forward_pre_hook(lambda *_: calls.append("encode"))
    model.lm_head.register_forward_pre_hook(lambda *_: calls.append("step"))
    tokens = model.stream(torch.randint(2, 64, (2, 5)), max_new_tokens=3, eos_token_id=None)
    assert calls == []  # checked at the call, but nothing runs before the first token is asked for
    first = next(tokens)
    assert calls == ["encode", "step"] and first.shape == (2,)
    assert not first.is_inference()  # usable in autograd, e.g. as a training target
    next(tokens)
    assert calls == ["encode", "step", "step"]
    assert len(list(tokens)) == 1 and calls.count("encode") == 1


def test_interleaved_streams_give_their_own_tokens_and_leave_the_training_flags() -> None:
    model = seq2seq(dropout=0.5)  # dropout would change the tokens of a step run in training mode
    model.train()
    model.decoder_layers[0].eval()  # a mixed state must come back exactly
    flags = [m.training for m in model.modules()]
    src_a, mask_a = sources(6, 64, 3)
    src_b, mask_b = sources(6, 64, 4)
    kwargs = dict(max_new_tokens=8, eos_token_id=None)
    expected_a = model.generate(src_a, mask_a, num_beams=1, **kwargs)[:, 1:]
    expected_b = model.generate(src_b, mask_b, num_beams=1, **kwargs)[:, 1:]
    assert not torch.equal(expected_a, expected_b)
    first, second = model.stream(src_a, mask_a, **kwargs), model.stream(src_b, mask_b, **kwargs)
    got_a, got_b = [next(first)], [next(second)]
    assert [m.training for m in model.modules()] == flags  # between tokens: as the caller left it
    for a, b in zip(first, second, strict=True):
        got_a.append(a)
        got_b.append(b)
        assert [m.training for m in model.modules()] == flags
    assert torch.equal(stacked(got_a), expected_a) and torch.equal(stacked(got_b), expected_b)
    abandoned = model.stream(src_a, mask_a, **kwargs)
    next(abandoned)
    abandoned.close()
    assert [m.training for m in model.modules()] == flags


def test_compiled_stream_equals_eager_and_checks_every_guard(
    graph_backend: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    skips: list[bool] = []
    call = compiled.CompiledStep.__call__

    def recording(self: compiled.CompiledStep, *args: object, skip_guards: bool = False) -> object:
        skips.append(skip_guards)
        return call(self, *args, skip_guards=skip_guards)

    monkeypatch.setattr(compiled.CompiledStep, "__call__", recording)
    model = seq2seq(eos_bias=4.0)
    src, mask = sources(6, 64, 0)
    kwargs = dict(max_new_tokens=12, eos_token_id=EOS)
    eager = stacked(list(model.stream(src, mask, **kwargs)))
    assert skips == []
    streamed = stacked(list(model.stream(src, mask, compile=True, **kwargs)))
    assert torch.equal(streamed, eager)
    assert len(skips) == eager.shape[1] - 1 and not any(skips)  # the caller runs code between steps
    skips.clear()
    model.generate(src, mask, num_beams=1, compile=True, **kwargs)
    assert skips[0] is False and all(skips[1:])  # generate's later steps may skip them
    sampled = dict(do_sample=True, top_k=8, repetition_penalty=1.3, max_new_tokens=10)
    a = model.stream(src, mask, generator=torch.Generator().manual_seed(1), compile=True, **sampled)
    b = model.stream(src, mask, generator=torch.Generator().manual_seed(1), **sampled)
    assert torch.equal(stacked(list(a)), stacked(list(b)))
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_streams_open_together_keep_their_own_caches(graph_backend: None) -> None:
    # Same shapes: the kept buffers of one stream must not be reused by the other, or by a generate call.
    model = seq2seq()
    src_a, mask_a = sources(6, 64, 5)
    src_b, mask_b = sources(6, 64, 6)
    kwargs = dict(max_new_tokens=10, eos_token_id=None)
    expected_a = model.generate(src_a, mask_a, num_beams=1, **kwargs)[:, 1:]
    expected_b = model.generate(src_b, mask_b, num_beams=1, **kwargs)[:, 1:]
    first = model.stream(src_a, mask_a, compile=True, **kwargs)
    second = model.stream(src_b, mask_b, compile=True, **kwargs)
    got_a, got_b = [next(first), next(first)], []
    for b in second:
        got_b.append(b)
        if len(got_b) == 3:  # a whole compiled generate call of the same shapes while both streams are open
            assert torch.equal(model.generate(src_b, mask_b, num_beams=1, compile=True, **kwargs)[:, 1:],
                               expected_b)
    got_a += list(first)
    assert torch.equal(stacked(got_a), expected_a) and torch.equal(stacked(got_b), expected_b)
    assert counters["stats"]["unique_graphs"] == 1  # another set of buffers is no new graph
    # Once the streams are over their buffers are free again: a later call makes no new set.
    (pool,) = s2s_compiled._BUFFERS[model].values()
    assert len(pool) == 3
    del first, second
    model.generate(src_a, mask_a, num_beams=1, compile=True, **kwargs)
    assert len(pool) == 3 and all(kept.free() for kept in pool)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0, got -1"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens=200), "max_len=128"),  # learned decoder positions
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(sampling=SamplingParams(), do_sample=True), "not both"),
        (dict(eos_token_id=64), "eos_token_id=64"),
        (dict(pad_token_id=-1), "pad_token_id=-1"),
        (dict(decoder_start_token_id=None), "decoder_start_token_id"),
        (dict(generator=3), "generator"),
        (dict(src_mask=torch.ones(2, 2, dtype=torch.bool)), "src_mask"),
        (dict(compile="yes"), "compile must be True or False, got 'yes'"),
    ],
)
def test_bad_input_raises_at_the_call(kwargs: dict, match: str) -> None:
    model = seq2seq(positional="learned", decoder_start_token_id=0)
    src = torch.randint(2, 64, (2, 5))
    with pytest.raises(ValueError, match=match):
        model.generate(src, num_beams=1, **kwargs)
    with pytest.raises(ValueError, match=match):
        model.stream(src, **kwargs)  # at the call, not at the first token


def test_bad_sources_and_beams_raise() -> None:
    model = seq2seq()
    with pytest.raises(ValueError, match="empty"):
        model.stream(torch.empty(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="src_ids"):
        model.stream(torch.tensor([[3, 64]]))  # 64 is outside the vocabulary
    with pytest.raises(ValueError, match="attention backends, the model uses 'flex'"):
        seq2seq(attention_backend="flex").stream(torch.tensor([[5, 6]]), compile=True)
    with pytest.raises(TypeError, match="num_beams"):  # beam search cannot stream
        model.stream(torch.tensor([[5, 6]]), num_beams=4)
