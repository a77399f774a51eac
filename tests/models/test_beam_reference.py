"""Beam search against an independent reference: exhaustive search over every hypothesis of a tiny vocabulary and
length, with and without the GNMT length penalty, on scripted models and on a real ``Seq2SeqTransformer``.

With enough beams to hold every live prefix, beam search is exact, so its result must be the arg-max over all
hypotheses of ``log P(Y) / ((5 + |Y|) / 6) ** alpha`` (Wu et al. 2016, eq. 14) — computed here by enumeration,
in float64, without the search's code. Early stopping is checked by counting decoding steps: a source may stop
after step t exactly when no live prefix, at any length it can still reach, can beat its best finished
hypothesis (enumerated here as well).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models import Seq2SeqConfig, Seq2SeqTransformer
from models.generation.beam_search import beam_search, gnmt_length_penalty

START, PAD = 0, 0  # the scripted models' start and pad ids (pad never competes: it only fills after EOS)
TIE = 1e-4  # scores closer than this are a tie (float32 search vs float64 enumeration)

#: ``log_probs(source, prefix)`` -> ``(V,)`` float64 next-token log-probabilities; ``prefix`` starts with START.
LogProbs = Callable[[int, tuple[int, ...]], torch.Tensor]


def lp(length: int, alpha: float) -> float:
    """GNMT's length penalty, written out independently of ``models.generation.beam_search``."""
    return ((5.0 + length) / 6.0) ** alpha


class Scripted:
    """A model whose next-token distribution is a fixed function of (source, prefix), as a ``StepFn``.

    It tracks which prefix each row holds from the ``parents`` it is given (so a search that reorders rows
    wrongly gets wrong logits), and records how many steps each source took part in.
    """

    def __init__(self, log_probs: LogProbs, batch_size: int) -> None:
        self.log_probs = log_probs
        self.rows: list[tuple[int, tuple[int, ...]]] = [(s, ()) for s in range(batch_size)]
        self.steps_per_source = [0] * batch_size
        self.calls = 0

    def __call__(self, tokens: torch.Tensor, parents: torch.Tensor | None, sources_changed: bool) -> torch.Tensor:
        self.calls += 1
        rows = self.rows if parents is None else [self.rows[i] for i in parents.tolist()]
        assert len(rows) == tokens.shape[0]
        self.rows = [(s, prefix + (t,)) for (s, prefix), t in zip(rows, tokens[:, -1].tolist(), strict=True)]
        for s in {s for s, _ in self.rows}:
            self.steps_per_source[s] += 1
        return torch.stack([self.log_probs(s, p) for s, p in self.rows]).float()


def random_log_probs(seed: int, vocab: int, eos: int | None, eos_bias: float, scale: float) -> LogProbs:
    """Log-probabilities drawn from a hash of (seed, source, prefix): the same whatever order they are asked in."""
    cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def log_probs(source: int, prefix: tuple[int, ...]) -> torch.Tensor:
        key = (source, prefix)
        if key not in cache:
            gen = torch.Generator().manual_seed(zlib.crc32(repr((seed, source, prefix)).encode()))
            logits = torch.randn(vocab, generator=gen, dtype=torch.float64) * scale
            if eos is not None:
                logits[eos] += eos_bias
            cache[key] = logits.log_softmax(-1)
        return cache[key]

    return log_probs


def hypotheses(log_probs: LogProbs, source: int, vocab: int, t_max: int, eos: int | None):
    """Every hypothesis ``(tokens, log P)``: sequences ending at their first EOS, or reaching ``t_max`` tokens."""
    out = []

    def visit(prefix: tuple[int, ...], log_p: float) -> None:
        if len(prefix) == t_max:
            out.append((prefix, log_p))
            return
        step = log_probs(source, (START, *prefix))
        for token in range(vocab):
            extended, total = (*prefix, token), log_p + float(step[token])
            if token == eos:
                out.append((extended, total))
            else:
                visit(extended, total)

    visit((), 0.0)
    return out


def best_hypothesis(hyps, alpha: float) -> tuple[tuple[int, ...], float]:
    return max(((y, log_p / lp(len(y), alpha)) for y, log_p in hyps), key=lambda h: h[1])


def optimal_stopping_step(log_probs: LogProbs, source: int, vocab: int, t_max: int, eos: int, alpha: float) -> int:
    """The first step after which the best finished hypothesis can no longer be beaten by any live prefix
    (whose log-probability can only fall, at any length it can still reach), else ``t_max``."""
    live: dict[tuple[int, ...], float] = {(): 0.0}
    best_finished = -math.inf
    for t in range(1, t_max + 1):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, log_p in live.items():
            step = log_probs(source, (START, *prefix))
            for token in range(vocab):
                if token == eos:
                    best_finished = max(best_finished, (log_p + float(step[token])) / lp(t, alpha))
                else:
                    grown[(*prefix, token)] = log_p + float(step[token])
        live = grown
        if t == t_max:
            return t
        reachable = max(log_p / lp(length, alpha) for log_p in live.values() for length in range(t + 1, t_max + 1))
        if best_finished >= reachable:
            return t
    return t_max


def exhaustive_beams(vocab: int, t_max: int, eos: int | None) -> int:
    """Beams enough to keep every live prefix: beam search is then exhaustive."""
    alive = (vocab - (eos is not None)) ** max(t_max - 1, 0)
    return max(1, alive, math.ceil(vocab * alive / 2))


def check_against_enumeration(found, log_probs: LogProbs, batch: int, vocab: int, t_max: int, eos: int | None,
                              alpha: float) -> None:
    """``found`` (a ``BeamSearchOutput``) holds each source's best hypothesis (up to exact ties) and its score."""
    for source in range(batch):
        hyps = hypotheses(log_probs, source, vocab, t_max, eos)
        best, best_score = best_hypothesis(hyps, alpha)
        length = int(found.lengths[source])
        got = tuple(found.sequences[source, :length].tolist())
        assert all(t == PAD for t in found.sequences[source, length:].tolist())
        assert found.scores[source].item() == pytest.approx(best_score, abs=TIE)
        if got != best:  # only an exact tie may pick another hypothesis
            scores = {y: log_p / lp(len(y), alpha) for y, log_p in hyps}
            assert got in scores and abs(scores[got] - best_score) < TIE, (got, best)


# ---------------------------------------------------------------------------------------------- the formula
def test_gnmt_length_penalty_is_pinned_to_the_formula() -> None:
    # Values of ((5 + |Y|) / 6) ** alpha worked out by hand (not by the function under test).
    assert gnmt_length_penalty(1, 0.6) == pytest.approx(1.0)
    assert gnmt_length_penalty(7, 0.6) == pytest.approx(1.515716566510398)  # 2 ** 0.6
    assert gnmt_length_penalty(3, 0.6) == pytest.approx(1.1884016386440022)  # (4/3) ** 0.6
    assert gnmt_length_penalty(10, 0.6) == pytest.approx(1.7328621078878659)  # 2.5 ** 0.6
    assert gnmt_length_penalty(20, 1.0) == pytest.approx(25 / 6)
    assert gnmt_length_penalty(13, 0.0) == pytest.approx(1.0)
    lengths = torch.tensor([1.0, 7.0, 19.0])
    torch.testing.assert_close(gnmt_length_penalty(lengths, 0.6), torch.tensor([1.0, 1.515716566510398, 2.0**1.2]))


def two_step_script(source: int, prefix: tuple[int, ...]) -> torch.Tensor:
    """EOS=1, 'a'=2, 'b'=3 (0 is the start token, never likely). Step 1: P(EOS)=0.4, P(a)=0.58;
    after 'a': P(EOS)=0.66. Raw log-probability prefers [EOS]; the length penalty prefers [a, EOS]."""
    table = {(START,): [1e-9, 0.40, 0.58, 0.02 - 1e-9], (START, 2): [1e-9, 0.66, 0.30, 0.04 - 1e-9]}
    probs = table.get(prefix, [1e-9, 0.97, 0.02, 0.01 - 1e-9])
    return torch.tensor(probs, dtype=torch.float64).log()


@pytest.mark.parametrize(
    ("alpha", "expected", "score"),
    [
        (0.0, [1], -0.916290731874155),  # log 0.4
        (0.6, [2, 1], -0.8754128233237618),  # log(0.58 * 0.66) / (7/6) ** 0.6
        (1.0, [2, 1], -0.8230651023457182),  # log(0.58 * 0.66) / (7/6)
    ],
)
@pytest.mark.parametrize("num_beams", [2, 4])
def test_the_length_penalty_decides_a_hand_worked_case(alpha: float, expected: list[int], score: float,
                                                       num_beams: int) -> None:
    # A search ranking by raw log-probability (or with the penalty replaced by 1) returns [EOS] for every alpha.
    found = beam_search(Scripted(two_step_script, 1), batch_size=1, start_token_id=START, num_beams=num_beams,
                        max_new_tokens=2, eos_token_id=1, pad_token_id=PAD, length_penalty=alpha)
    assert found.sequences[0].tolist() == expected
    assert found.scores[0].item() == pytest.approx(score, abs=1e-6)
    assert found.lengths.tolist() == [len(expected)]


# ---------------------------------------------------------------------------------------------- exhaustive
@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 4),
    t_max=st.integers(1, 4),
    batch=st.integers(1, 2),
    alpha=st.sampled_from([0.0, 0.6, 1.0, 2.0, -0.5]),
    eos_bias=st.floats(-1.0, 3.0),
    scale=st.sampled_from([0.5, 2.0]),
    with_eos=st.booleans(),
    early_stopping=st.booleans(),
)
def test_exhaustive_beam_search_finds_the_best_hypothesis(
    seed: int, vocab: int, t_max: int, batch: int, alpha: float, eos_bias: float, scale: float, with_eos: bool,
    early_stopping: bool,
) -> None:
    eos = 1 if with_eos else None
    log_probs = random_log_probs(seed, vocab, eos, eos_bias, scale)
    step = Scripted(log_probs, batch)
    found = beam_search(step, batch_size=batch, start_token_id=START, num_beams=exhaustive_beams(vocab, t_max, eos),
                        max_new_tokens=t_max, eos_token_id=eos, pad_token_id=PAD, length_penalty=alpha,
                        early_stopping=early_stopping)
    check_against_enumeration(found, log_probs, batch, vocab, t_max, eos, alpha)
    if eos is None or not early_stopping:
        assert step.calls == t_max  # no early end is possible / allowed
    else:
        expected = [optimal_stopping_step(log_probs, s, vocab, t_max, eos, alpha) for s in range(batch)]
        assert step.steps_per_source == expected
        assert step.calls == max(expected)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_early_stopping_stops_after_the_first_step_when_eos_is_certain(alpha: float) -> None:
    # Step 1: EOS with 0.9; every other hypothesis starts below log 0.1 / lp(10) and can only fall.
    def log_probs(source: int, prefix: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor([0.1 / 3, 0.9, 0.1 / 3, 0.1 / 3], dtype=torch.float64).log()

    for early, calls in ((True, 1), (False, 10)):
        step = Scripted(log_probs, 2)
        found = beam_search(step, batch_size=2, start_token_id=START, num_beams=3, max_new_tokens=10,
                            eos_token_id=1, pad_token_id=PAD, length_penalty=alpha, early_stopping=early)
        assert found.sequences.tolist() == [[1], [1]]
        assert step.calls == calls


def test_early_stopping_waits_while_a_longer_hypothesis_can_still_win() -> None:
    # alpha = 2, at most 4 tokens. Step 1: [EOS] finishes with log 0.5 = -0.693, the best live prefix [a] has
    # log 0.3 = -1.204: at length 2 it could score no more than -1.204 / lp(2) = -0.885 (worse), but at length 4
    # -1.204 / lp(4) = -0.535 (better). Stopping now would be wrong: [a, a, a, EOS] wins with about -0.537.
    def log_probs(source: int, prefix: tuple[int, ...]) -> torch.Tensor:
        if len(prefix) == 1:
            probs = [1e-9, 0.5, 0.3, 0.2 - 1e-9]
        elif len(prefix) < 4:
            probs = [1e-9, 0.001, 0.998, 0.001 - 1e-9]
        else:
            probs = [1e-9, 0.998, 0.001, 0.001 - 1e-9]
        return torch.tensor(probs, dtype=torch.float64).log()

    step = Scripted(log_probs, 1)
    found = beam_search(step, batch_size=1, start_token_id=START, num_beams=2, max_new_tokens=4, eos_token_id=1,
                        pad_token_id=PAD, length_penalty=2.0)
    assert found.sequences.tolist() == [[2, 2, 2, 1]]
    assert found.scores.item() == pytest.approx(math.log(0.3 * 0.998**3) / (9 / 6) ** 2, abs=1e-6)
    assert step.calls == optimal_stopping_step(log_probs, 0, 4, 4, 1, 2.0) == 4


def test_sources_stop_at_their_own_step() -> None:
    # Source 0 is settled after step 1; source 1 only after step 3 (its EOS is unlikely until then), and the
    # search must carry on with source 1 alone.
    def log_probs(source: int, prefix: tuple[int, ...]) -> torch.Tensor:
        if source == 0 or len(prefix) >= 3:
            probs = [0.01, 0.97, 0.01, 0.01]
        else:
            probs = [0.01, 0.01, 0.97, 0.01]
        return torch.tensor(probs, dtype=torch.float64).log()

    step = Scripted(log_probs, 2)
    found = beam_search(step, batch_size=2, start_token_id=START, num_beams=2, max_new_tokens=8, eos_token_id=1,
                        pad_token_id=PAD, length_penalty=0.6)
    expected = [optimal_stopping_step(log_probs, s, 4, 8, 1, 0.6) for s in range(2)]
    assert expected == [1, 3]
    assert step.steps_per_source == expected
    assert found.sequences.tolist() == [[1, PAD, PAD], [2, 2, 1]]


# ---------------------------------------------------------------------------------------------- a real model
SMALL = 6  # ids 0..5: pad 0, unk 1, bos 2 (the decoder start), eos 3, two more


@settings(max_examples=6)
@given(seed=st.integers(0, 2**16), alpha=st.sampled_from([0.0, 0.6, 1.0]), early_stopping=st.booleans())
def test_seq2seq_beam_search_with_exhaustive_beams_equals_enumeration(seed: int, alpha: float,
                                                                      early_stopping: bool) -> None:
    torch.manual_seed(seed)
    config = Seq2SeqConfig(vocab_size=SMALL, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                           max_len=16, dropout=0.0)
    model = Seq2SeqTransformer(config).eval()
    with torch.no_grad():  # a wider spread of logits than the initialisation gives, so that hypotheses differ
        model.lm_head.weight.mul_(4.0)
    src = torch.randint(4, SMALL, (2, 3))
    t_max, eos, start = 3, config.eos_token_id, config.decoder_start_token_id
    out, scores = model.generate(src, max_new_tokens=t_max, num_beams=exhaustive_beams(SMALL, t_max, eos),
                                 length_penalty=alpha, early_stopping=early_stopping, return_scores=True)

    @torch.no_grad()
    def log_probs(source: int, prefix: tuple[int, ...]) -> torch.Tensor:
        tgt = torch.tensor([[start, *prefix[1:]]])
        return model(src[source : source + 1], tgt).logits[0, -1].double().log_softmax(-1)

    for source in range(2):
        hyps = hypotheses(log_probs, source, SMALL, t_max, eos)
        best, best_score = best_hypothesis(hyps, alpha)
        assert scores[source].item() == pytest.approx(best_score, abs=TIE)
        row = out[source, 1:].tolist()
        got = tuple(row[: row.index(eos) + 1] if eos in row else row)
        if got != best:
            others = {y: log_p / lp(len(y), alpha) for y, log_p in hyps}
            assert abs(others[got] - best_score) < TIE, (got, best)


def test_enumeration_covers_every_sequence() -> None:
    # The reference itself: V=3, T=2 with EOS=1 has 1 + 2 * (1 + 2) = 7 hypotheses whose probabilities sum to 1.
    log_probs = random_log_probs(0, 3, 1, 0.0, 1.0)
    hyps = hypotheses(log_probs, 0, 3, 2, 1)
    assert sorted(y for y, _ in hyps) == sorted(
        [(1,)] + [(a, b) for a, b in itertools.product([0, 2], [0, 1, 2])]
    )
    assert sum(math.exp(log_p) for _, log_p in hyps) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha", [-0.5, -1.0, -3.0])
@pytest.mark.parametrize("seed", range(8))
def test_early_stopping_with_a_negative_length_penalty_equals_enumeration(alpha: float, seed: int) -> None:
    # alpha < 0 makes lp fall with the length: a live beam's best reachable score is at its next length, not at
    # max_new_tokens (a bound taken there stops too early and loses the best hypothesis). Fixed seeds, so every
    # run checks cases that stop early and cases that must wait (the hypothesis test above may draw few of them).
    vocab, t_max, eos, batch = 3, 4, 1, 2
    log_probs = random_log_probs(seed, vocab, eos, 0.5, 2.0)
    step = Scripted(log_probs, batch)
    found = beam_search(step, batch_size=batch, start_token_id=START, num_beams=exhaustive_beams(vocab, t_max, eos),
                        max_new_tokens=t_max, eos_token_id=eos, pad_token_id=PAD, length_penalty=alpha,
                        early_stopping=True)
    check_against_enumeration(found, log_probs, batch, vocab, t_max, eos, alpha)
    expected = [optimal_stopping_step(log_probs, s, vocab, t_max, eos, alpha) for s in range(batch)]
    assert step.steps_per_source == expected


def test_negative_length_penalty_cases_stop_early_and_late() -> None:
    # The seeds above cover both: some sources settle before max_new_tokens, some only at it.
    stops = {optimal_stopping_step(random_log_probs(seed, 3, 1, 0.5, 2.0), s, 3, 4, 1, alpha)
             for seed in range(8) for s in range(2) for alpha in (-0.5, -1.0, -3.0)}
    assert min(stops) < 4 and 4 in stops and len(stops) >= 3
