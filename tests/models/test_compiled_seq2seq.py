"""Compiled static-shape seq2seq decoding (greedy, sampling, beam search): one graph per search kind across source
lengths, target lengths and calls; tokens identical to the eager path (itself checked against transformers and
an uncached search in test_beam_reference.py / test_generation.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import models.generation.compiled as compiled
import models.generation.seq2seq_compiled as s2s_compiled
import models.generation.steps as steps
from models import Seq2SeqConfig, Seq2SeqTransformer
from tests.models.test_kv_cache import build

EOS = 1


def seq2seq(vocab: int = 64, eos_bias: float = 0.0, **overrides: object) -> Seq2SeqTransformer:
    """A tiny model with peaked logits (output weights × 4) and an adjustable EOS bias."""
    config = dict(
        vocab_size=vocab, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=2, max_len=128,
        dropout=0.0, output_bias=True, bos_token_id=0, eos_token_id=EOS, pad_token_id=0,
    )
    model = build(Seq2SeqTransformer, Seq2SeqConfig(**{**config, **overrides}), 0)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        model.lm_head.bias[EOS] = eos_bias
    return model


def sources(length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four sources, one left-padded and one right-padded."""
    src = torch.randint(2, vocab, (4, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(4, length, dtype=torch.bool)
    mask[1, :2] = False
    mask[2, -3:] = False
    return src, mask


@pytest.fixture
def search_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows beam search asks the compiled step for, at each step."""
    rows: list[int] = []
    make = s2s_compiled.beam_step

    def recording(*args: object, **kwargs: object):
        step = make(*args, **kwargs)

        def wrapped(tokens: torch.Tensor, parents: torch.Tensor | None, changed: bool) -> torch.Tensor:
            rows.append(tokens.shape[0])
            return step(tokens, parents, changed)

        return wrapped

    monkeypatch.setattr(s2s_compiled, "beam_step", recording)
    return rows


def test_one_graph_per_search_for_three_source_and_target_lengths_and_repeated_calls(graph_backend: None) -> None:
    model = seq2seq()
    # One source bucket and one target bucket (64); the last call repeats the second.
    for call, (length, new) in enumerate([(5, 10), (9, 14), (14, 20), (9, 14)]):
        src, mask = sources(length, 64, call)
        for beams in (1, 4):
            kwargs = dict(max_new_tokens=new, num_beams=beams, return_scores=True)
            ids, scores = model.generate(src, mask, compile=True, **kwargs)
            eager_ids, eager_scores = model.generate(src, mask, **kwargs)
            assert torch.equal(ids, eager_ids)
            torch.testing.assert_close(scores, eager_scores)
        if call == 0:
            graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
            assert graphs == 2  # the greedy step and the beam step (with its reorder), each compiled once
    assert counters["stats"]["unique_graphs"] == graphs and counters["frames"]["total"] == frames


# (vocab, EOS bias, source length, seed): with these, sources end at different steps and leave the search while
# others go on; vocab 3 < num_beams: the first steps keep fewer beams than asked (1, then 3, then 4 per source).
CASES = [(64, 4.0, 5, 0), (64, 6.0, 14, 1), (3, 0.0, 9, 0)]


@pytest.mark.parametrize(("vocab", "eos_bias", "length", "seed"), CASES)
def test_beam_search_with_sources_leaving_at_different_steps_matches_eager(
    graph_backend: None, search_rows: list[int], vocab: int, eos_bias: float, length: int, seed: int
) -> None:
    model = seq2seq(vocab, eos_bias)
    src, mask = sources(length, vocab, seed)
    kwargs = dict(max_new_tokens=20, num_beams=4, return_scores=True, eos_token_id=EOS)
    ids, scores = model.generate(src, mask, compile=True, **kwargs)
    eager_ids, eager_scores = model.generate(src, mask, **kwargs)
    assert torch.equal(ids, eager_ids)
    torch.testing.assert_close(scores, eager_scores)
    if vocab == 3:
        assert search_rows[:3] == [4, 12, 16], search_rows
    else:
        # Rows shrank after the search had started: the remaining beams were mapped onto their fixed rows.
        assert any(a > b > 0 for a, b in zip(search_rows[1:], search_rows[2:], strict=False)), search_rows
        lengths = (ids != 0).sum(1)
        assert lengths.min() < lengths.max(), ids  # outputs of different lengths in one batch


def test_greedy_sampling_and_repetition_penalty_match_eager(graph_backend: None) -> None:
    model = seq2seq(positional="learned")
    src, mask = sources(7, 64, 3)
    greedy = dict(max_new_tokens=15, num_beams=1, eos_token_id=None)
    assert torch.equal(model.generate(src, mask, compile=True, **greedy), model.generate(src, mask, **greedy))
    sampled = dict(do_sample=True, top_k=8, repetition_penalty=1.3, num_beams=1, max_new_tokens=15)
    a = model.generate(src, mask, generator=torch.Generator().manual_seed(1), compile=True, **sampled)
    b = model.generate(src, mask, generator=torch.Generator().manual_seed(1), **sampled)
    assert torch.equal(a, b)


@pytest.mark.parametrize("beams", [1, 4])
def test_a_full_bucket_moves_to_the_next_with_the_same_tokens_and_scores(
    graph_backend: None, bucket_sizes: list[int], monkeypatch: pytest.MonkeyPatch, beams: int
) -> None:
    # One new token of room at first and buckets from 8: the loop starts in the 8 bucket and must move to 16 at
    # slot 8. Sampled tokens (greedy search) and beam scores are functions of every step's logits.
    monkeypatch.setattr(steps, "CACHE_CHUNK", 1)
    monkeypatch.setattr(compiled, "MIN_BUCKET", 8)
    model = seq2seq(positional="learned")
    src, mask = sources(6, 64, 5)
    kwargs = dict(max_new_tokens=14, num_beams=beams, eos_token_id=None)
    if beams == 1:
        kwargs.update(do_sample=True, temperature=4.0)
    else:
        kwargs.update(return_scores=True)
    got = model.generate(src, mask, compile=True, generator=torch.Generator().manual_seed(2), **kwargs)
    want = model.generate(src, mask, generator=torch.Generator().manual_seed(2), **kwargs)
    if beams == 1:
        assert torch.equal(got, want)
        assert got.shape[1] >= 14 and len(set(got[0, 9:].tolist())) > 3  # varied tokens past slot 8
    else:
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    assert sorted(set(bucket_sizes)) == [8, 16]  # grew once
    assert counters["stats"]["unique_graphs"] == 2  # one graph per bucket


@pytest.mark.parametrize("beams", [1, 3])
def test_huge_max_new_tokens_allocates_the_first_bucket_only(graph_backend: None, bucket_sizes: list[int],
                                                             beams: int) -> None:
    # EOS at the first token: with max_new_tokens = 2**21 the bucket was sized for all of them (2**21 slots per
    # layer and row, 512 MB here); now it holds the start token and CACHE_CHUNK = 256 new ones.
    model = seq2seq(positional="rotary", eos_bias=50.0)  # every beam's best continuation is EOS
    src = torch.tensor([[5, 6, 7]])
    out = model.generate(src, max_new_tokens=2**21, eos_token_id=EOS, num_beams=beams, compile=True)
    assert out[0, -1].item() == EOS and out.shape[1] <= 3
    assert steps.CACHE_CHUNK == 256 and bucket_sizes == [512] * 2  # one per decoder layer


def test_unsupported_combinations_raise() -> None:
    model, src = seq2seq(), torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="compile must be True or False, got 'yes'"):
        model.generate(src, compile="yes")
    with pytest.raises(ValueError, match="attention backends, the model uses 'flex'"):
        seq2seq(attention_backend="flex").generate(src, compile=True)
    model.set_attention_backend("chunked")  # a runtime switch is seen too
    with pytest.raises(ValueError, match="attention backends, the model uses 'chunked'"):
        model.generate(src, num_beams=4, compile=True)


@pytest.mark.slow
def test_inductor_tokens_equal_eager() -> None:
    model = seq2seq()
    src, mask = sources(6, 64, 4)
    for beams in (1, 4):
        kwargs = dict(max_new_tokens=10, num_beams=beams, eos_token_id=EOS)
        assert torch.equal(model.generate(src, mask, compile=True, **kwargs), model.generate(src, mask, **kwargs))
