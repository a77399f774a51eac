"""``benchmarks.multi_lora --quick``: runs, and multi-LoRA batching gives the tokens of the merged models."""

from __future__ import annotations

import pytest

from benchmarks import multi_lora


def test_quick_run_matches_the_merged_models() -> None:
    rows = multi_lora.main(["--quick", "--threads", "1"])
    row = rows["quick"]
    assert row["mismatched"] == 0 and row["multi_tok_s"] > 0 and row["base_tok_s"] > 0 and row["merged_tok_s"] > 0


@pytest.mark.parametrize("flag", [["--requests", "0"], ["--ranks", "9", "8"]])
def test_bad_flags_are_refused(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        multi_lora.main(flag)
    assert flag[0] in capsys.readouterr().err
