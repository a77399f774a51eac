"""``benchmarks.serve --quick`` runs: both servers (engine process, in-process thread), ``AsyncEngine`` and the engine
in-process serve the same workload and every row reports the engine's greedy tokens."""

from __future__ import annotations

from benchmarks import serve


def test_quick_benchmark_rows_report_the_same_tokens(capsys) -> None:
    results = serve.main(["--quick"])
    names = [r.name for r in results]
    assert names == ["server (engine process)", "server (in-process thread engine)",
                     "AsyncEngine in-process (no HTTP)", "engine"]
    engine = results[-1]
    assert sum(map(len, engine.tokens.values())) > 0
    assert all(r.tokens == engine.tokens for r in results)
    table = capsys.readouterr().out
    assert table.count("| 8/8 |") == len(results) and "server (engine process): HTTP overhead" in table
