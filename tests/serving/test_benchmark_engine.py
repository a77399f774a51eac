"""``benchmarks.engine --quick`` runs end to end: the engine, the sequential compiled baseline (compiled with
``aot_eager`` here, to skip inductor's C++ build) and transformers' continuous batching give the same greedy tokens."""

from __future__ import annotations

import pytest

from benchmarks import engine as bench
from models.generation import compiled


def test_quick_run_reports_every_system_with_equal_tokens(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setitem(bench.SHAPES, "demo", dict(bench.SHAPES["demo"]))
    (name, results), = bench.main(["--quick", "--threads", "1"])
    assert name == "demo" and [r.name.split()[0] for r in results] == ["engine", "(a)", "(b)"]
    engine = results[0]
    for result in results:
        assert result.tokens == engine.tokens and result.tokens_per_s > 0
        assert len(result.ttft) == 8 and all(t >= 0 for t in result.ttft)
    assert engine.extra["kv_peak"] > 0
    assert "| engine |" in capsys.readouterr().out


def test_step_rows_times_one_decode_step_per_compile_mode(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setitem(bench.SHAPES, "demo", dict(bench.SHAPES["demo"]))
    assert bench.main(["--quick", "--threads", "1", "--step-rows", "5"]) == []
    out = capsys.readouterr().out
    assert "one decode step of 5 rows" in out
    assert all(f"| {mode} |" in out for mode in ("False", "'attention'", "True"))
