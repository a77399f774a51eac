"""``benchmarks.engine_prepack``: a quick run times plain and prepacked weights in one process, one request and
several in flight, with the same tokens; bad flags are refused."""

from __future__ import annotations

import pytest

from benchmarks import engine_prepack
from blocks import prepacked_linear


def test_a_quick_run_times_both_layouts(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(prepacked_linear, "MIN_ELEMENTS", 0)  # the tiny model's weights are all small
    report = engine_prepack.main(["--quick"])
    assert set(report) == {"plain", "prepacked"}
    assert report["prepacked"]["prepacked"] > 0 and report["plain"]["prepacked"] == 0
    assert all(len(r["tok_s"][n]) == 1 and r["tok_s"][n][0] > 0 for r in report.values() for n in (1, 4))
    assert report["plain"]["tokens"] == report["prepacked"]["tokens"]
    out = capsys.readouterr().out
    assert "prepacked vs plain, 4 in flight:" in out and "same tokens: 4/4 requests" in out


@pytest.mark.parametrize("flag", [["--concurrency", "0"], ["--gen-len", "0"], ["--threads", "0"],
                                  ["--kv-cache-dtype", "fp8"]])
def test_bad_flags_are_refused(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_prepack.main(flag)
    assert flag[0] in capsys.readouterr().err
