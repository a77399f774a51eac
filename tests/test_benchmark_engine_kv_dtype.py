"""``benchmarks.engine_kv_dtype``: a quick run times both caches in one process (the float16 one holding half the
bytes) and bad flags are refused."""

from __future__ import annotations

import pytest

from benchmarks import engine_kv_dtype


def test_a_quick_run_times_both_caches(capsys: pytest.CaptureFixture[str]) -> None:
    report = engine_kv_dtype.main(["--quick"])
    assert set(report) == {"auto", "float16"}
    assert all(len(r["tok_s"]) == 1 and r["tok_s"][0] > 0 for r in report.values())
    assert report["float16"]["pool_bytes"] * 2 == report["auto"]["pool_bytes"] > 0
    out = capsys.readouterr().out
    assert "kv auto:" in out and "kv float16:" in out and "float16 cache vs float32:" in out


@pytest.mark.parametrize("flag", [["--concurrency", "0"], ["--gen-len", "0"], ["--rounds", "-1"], ["--threads", "0"]])
def test_bad_flags_are_refused(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_kv_dtype.main(flag)
    assert flag[0] in capsys.readouterr().err
