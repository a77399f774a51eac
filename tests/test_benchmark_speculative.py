"""``python -m benchmarks.speculative``: --quick prints a full table; the measuring loop checks greedy identity."""

from __future__ import annotations

import pytest
import torch

import benchmarks.speculative as bench
import models.generation.compiled as compiled
from models.generation.speculative import SpeculativeOutput
from tests.models.test_speculative import decoder, perturbed
from training import CausalLMCollator


def test_quick_run_prints_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    # End to end: the example trains a (tiny) target, the script trains a draft with its tokenizer, distils a copy
    # of it on the target's continuations, and measures both.
    table = bench.main(["--quick", "--distill"])
    printed = capsys.readouterr().out
    modes = ["greedy", "sample T=0.8"]
    # Per mode: the plain row and one row per draft and k (--quick: one shape, plain and distilled, k = 2 and 3).
    assert [(r[0], r[1], r[2]) for r in table.rows] == [
        (m, d, k) for m in modes
        for d, k in [("-", "-"), ("1x16", "2"), ("1x16", "3"), ("1x16-distilled", "2"), ("1x16-distilled", "3")]
    ]
    assert "distillation data: 16 target continuations of training-split prompts" in printed
    for row in table.rows:
        assert row[3] == "no" and float(row[6]) > 0 and row[7].endswith("x")  # tokens/s and speed-up measured
        if row[1] != "-":
            assert 0.0 <= float(row[4].rstrip("%")) <= 100.0 and 1.0 <= float(row[5]) <= int(row[2]) + 1
    assert table.render() in printed and "greedy speculative output was checked" in printed


def test_measure_counts_and_checks_greedy_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    target = decoder(0)
    draft = perturbed(target, 0.3)
    prompts = [torch.tensor([[1, 5, 6, 7]]), torch.tensor([[1, 9, 3]])]
    results = bench.measure(target, {"d": draft}, prompts, [1, 3], new_tokens=10, temperature=0.8, repeats=2,
                            seed=0)
    greedy = results[("greedy", "d", 3, False)]
    assert len(greedy.tokens_per_s) == 2 and greedy.proposed > 0 and 0 < greedy.accepted <= greedy.proposed
    # Two repeats of the same greedy decoding: twice one pass's counts, and one target pass per round.
    assert greedy.tokens == 2 * sum(target.generate(p, max_new_tokens=10).shape[1] - p.shape[1] for p in prompts)
    table = bench.table(results, "t", [])
    assert len(table.rows) == 2 * (1 + 2) and table.rows[0][7] == "1.00x"

    # A speculative decoder that changes a greedy token must stop the script.
    real = bench.speculative_decode

    def wrong(*args: object, **kwargs: object) -> SpeculativeOutput:
        out = real(*args, **kwargs)
        out.sequences[0, -1] = (out.sequences[0, -1] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(bench, "speculative_decode", wrong)
    with pytest.raises(SystemExit, match="compiled=False differs from plain greedy output on prompt 0"):
        bench.measure(target, {"d": draft}, prompts, [2], new_tokens=6, temperature=0.8, repeats=1, seed=0)


def test_distillation_loss_is_the_kl_to_the_target() -> None:
    target, student = decoder(0), decoder(1)
    batch = CausalLMCollator(pad_token_id=0)([{"input_ids": [2, 5, 6, 7, 8]}, {"input_ids": [2, 9, 3]}])
    loss_fn = bench.DistillationLoss(target)
    # Reference: KL(p || q) = sum_v p (log p - log q), summed by hand over the positions that predict a real token.
    p = torch.softmax(target(batch["input_ids"]).logits, -1)
    q = torch.softmax(student(batch["input_ids"]).logits, -1)
    kl = (p * (p.log() - q.log())).sum(-1)  # (B, L)
    keep = torch.tensor([[True, True, True, True, False], [True, True, False, False, False]])
    assert loss_fn.count(batch) == 6
    torch.testing.assert_close(loss_fn(student, batch), kl[keep].sum(), rtol=1e-4, atol=1e-5)
    assert float(loss_fn(target, batch).detach()) == pytest.approx(0.0, abs=1e-5)  # the target imitates itself
    loss_fn(student, batch).backward()  # the gradient reaches the student only
    assert all(p.grad is not None for p in student.parameters())
    assert all(p.grad is None for p in target.parameters())


def test_target_continuations_are_the_targets_own_tokens() -> None:
    target = decoder(0, vocab_size=64)

    class Ids:  # a tokenizer stand-in for ``examples.generate._encode``: documents already are id lists
        def __call__(self, docs: list[list[int]], **_: object) -> dict[str, list[list[int]]]:
            return {"input_ids": [list(d) for d in docs]}

    docs = [[2, *range(10 + i, 20 + i)] for i in range(3)] + [[2, 5]]  # the last is too short to give a prompt
    rows = bench.target_continuations(target, Ids(), docs, n=5, prompt_tokens=4, temperature=0.8, seed=0, batch=2)
    assert len(rows) == 2 * 3  # each usable training prompt once greedy, once sampled
    eos = target.config.eos_token_id
    for doc, row in zip(docs[:3], rows[:3], strict=True):
        # Greedy rows: exactly what the target generates alone from that prompt (up to EOS or max_len).
        alone = target.generate(torch.tensor([doc[:4]]), max_new_tokens=target.config.max_len - 4)[0].tolist()
        assert row == alone and row[:4] == doc[:4]
        assert eos not in row[4:-1]
    assert all(r[:4] == d[:4] for r, d in zip(rows[3:], docs[:3], strict=True))


def test_bad_arguments_exit() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--draft", "1by64"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--ks", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--distill-only"])  # nothing to measure without --distill
    with pytest.raises(SystemExit):
        bench.parse_args(["--distill", "--distill-steps", "0"])
    with pytest.raises(ValueError, match="LAYERSxD_MODEL"):
        bench.parse_shape("x64")
    with pytest.raises(ValueError, match="multiple of 16 .*got 40"):
        bench.parse_shape("1x40")
    assert bench.parse_shape("2X64") == (2, 64)
    assert bench.parse_args(["--distill", "--no-distill-corpus"]).distill_corpus is False


def test_compiled_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # "aot_eager": the same captured graphs as inductor without its C++ build (timings are not the point here).
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    target = decoder(0)
    results = bench.measure(target, {"d": perturbed(target, 0.3)}, [torch.tensor([[1, 5, 6, 7]])], [2],
                            new_tokens=6, temperature=0.8, repeats=1, seed=0, compiled=True)
    table = bench.table(results, "t", [])
    assert table.columns[-1] == "vs compiled plain"
    assert [(r[1], r[3]) for r in table.rows[:4]] == [("-", "no"), ("-", "yes"), ("d", "no"), ("d", "draft")]
    assert table.rows[1][-1] == "1.00x" and all(float(r[6]) > 0 for r in table.rows)
