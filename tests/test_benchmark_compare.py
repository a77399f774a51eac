"""``python -m benchmarks.compare --quick`` prints every row with figures, and benchmarks/README.md records them."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import models.generation.compiled
from benchmarks import compare

README = Path(__file__).resolve().parents[1] / "benchmarks" / "README.md"
ROWS = {"1", "2", "3a", "3b", "4", "5", "6", "7"}


def tables(markdown: str) -> dict[str, list[str]]:
    """{row number: the data lines of its table} for every ``### N. title`` (or ``####``) heading."""
    found: dict[str, list[str]] = {}
    current = None
    for line in markdown.splitlines():
        heading = re.match(r"#{3,4} (\w+)\. ", line)
        if heading:
            current = heading.group(1)
            found[current] = []
        elif current and line.startswith("|") and not re.fullmatch(r"\|[-|]+\|", line):
            found[current].append(line)
        elif current and found[current] and not line.startswith("|"):
            current = None  # the table ended
    return {name: lines[1:] for name, lines in found.items()}  # the first line is the header


@pytest.fixture(scope="module")
def quick_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(models.generation.compiled, "BACKEND", models.generation.compiled.BACKEND)  # restored after
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        compare.main(["--quick", "--no-memory"])
    torch._dynamo.reset()
    return out.getvalue()


def test_quick_run_prints_every_row_with_figures(quick_output: str) -> None:
    printed = tables(quick_output)
    assert set(printed) == ROWS
    for name, rows in printed.items():
        assert rows, f"row {name} printed an empty table"
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert any(re.fullmatch(r"[\d.]+x?", c) for c in cells), f"row {name} has no figure: {row}"
    decoding = {tuple(c.strip() for c in r.strip("|").split("|")[:2]) for r in printed["4"]}
    assert {("1", "zoo compiled"), ("8", "zoo compiled"), ("1", "transformers eager")} <= decoding


def test_readme_records_every_row() -> None:
    recorded = tables(README.read_text())
    assert ROWS <= set(recorded), f"benchmarks/README.md lacks rows {sorted(ROWS - set(recorded))}"
    for name in ROWS:
        assert recorded[name], f"benchmarks/README.md: the table of row {name} is empty"


def test_table_parser_sees_an_empty_table() -> None:
    text = "### 4. Decoding\n\n| a | b |\n|---|---|\n\n- note\n### 5. Next\n\n| a |\n|---|\n| 1 |\n"
    assert tables(text) == {"4": [], "5": ["| 1 |"]}
