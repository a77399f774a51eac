"""Docs that cannot rot: every Python block of the README and the guides runs, and the site builds in strict mode.

A fence written `` ```python `` is executed here, each block on its own (a fresh namespace, the working directory a
temporary folder), so a block must be complete: imports, tiny models, no network. What a block names but does not
create — a checkpoint folder, a GGUF file, a Hub repo, the server it talks to on ``127.0.0.1:8000`` — comes from the
hidden setup of ``tests/docs_setup.py``, offline (a tiny local stand-in, an in-process Hub, a server on a free port).
A fence written `` ```python slow `` (a server, a Hub round trip, a long run) runs the same way, but only in
``make test-all`` (it is marked ``slow``). A fence written `` ```python notest `` (it needs what no test machine has:
a GPU, the real Hub) is compiled but not executed, so its syntax is still checked; its first line is a comment
saying why. Other fences (``bash``, ``text``...) are not read.

``mkdocs build --strict`` fails on a broken link, a nav entry without its page, a reference that does not resolve
and a docstring mkdocstrings cannot parse.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import blocks
from tests import docs_setup

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`\n]*)$")


def markdown_files() -> list[Path]:
    """The README and every page of the docs site, API pages included."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str  # the words after the backticks: "python", "python slow", "python notest", "bash", ...
    source: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def runs(self) -> bool:
        return self.language == "python" and "notest" not in self.info.split()[1:]

    @property
    def slow(self) -> bool:
        return self.runs and "slow" in self.info.split()[1:]

    @property
    def label(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[CodeBlock]:
    """The fenced code blocks of a Markdown file, indented ones (inside list items) dedented."""
    blocks: list[CodeBlock] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, ticks, info = m["indent"], m["ticks"], m["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip() == ticks and lines[j].startswith(indent)):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: the fence {ticks}{info} is never closed")
        blocks.append(CodeBlock(path, i + 1, info, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks() -> list[CodeBlock]:
    return [b for p in markdown_files() for b in code_blocks(p) if b.language == "python"]


def test_the_docs_have_runnable_blocks() -> None:
    """The collection below finds what it should (a parser that found nothing would pass every test vacuously)."""
    blocks = python_blocks()
    assert sum(b.runs and not b.slow for b in blocks) >= 10
    assert any(b.path.name == "README.md" and b.runs for b in blocks)
    assert any(b.slow for b in blocks), "no slow block found: is the slow convention still parsed?"
    for block in blocks:
        assert block.language == "python" and set(block.info.split()[1:]) <= {"slow", "notest"}, block.label
        if not block.runs:
            assert block.source.startswith("#"), f"{block.label}: a notest block starts with a comment saying why"


def test_the_parser_reads_fences_inside_list_items(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("- item\n\n  ```python\n  x = 1\n  ```\n\n```python notest\n# GPU\n```\n\n"
                    "```python slow\nserve()\n```\n\n```bash\nls\n```\n")
    blocks = code_blocks(page)
    assert [(b.info, b.source, b.runs, b.slow) for b in blocks] == [
        ("python", "x = 1\n", True, False), ("python notest", "# GPU\n", False, False),
        ("python slow", "serve()\n", True, True), ("bash", "ls\n", False, False)]


def test_the_hidden_setup_reads_what_a_block_names() -> None:
    source = 'm = from_pretrained("ckpt")\nclient = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="k")\n'
    assert {"ckpt", "k"} <= docs_setup.names(source)
    assert set(docs_setup.LOCAL_FILES) | set(docs_setup.HUB_REPOS) <= {
        n for b in python_blocks() for n in docs_setup.names(b.source)}, "a stand-in no block uses: remove it"


@pytest.fixture(scope="session")
def docs_assets(tmp_path_factory: pytest.TempPathFactory) -> docs_setup.Assets:
    return docs_setup.Assets(tmp_path_factory.mktemp("docs-assets"))


@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if b.slow else b for b in python_blocks()],
                         ids=lambda b: b.label)
def test_python_block(block: CodeBlock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      docs_assets: docs_setup.Assets) -> None:
    compile(block.source, block.label, "exec")  # notest blocks too: their syntax is checked
    if not block.runs:
        return
    monkeypatch.chdir(tmp_path)
    with docs_setup.prepared(block.source, tmp_path, monkeypatch, docs_assets) as source:
        exec(compile(source, block.label, "exec"), {"__name__": "__docs__"})


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    # not --quiet: it hides the warnings that --strict counts
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "api" / "models" / "index.html").exists()


def test_the_blocks_page_lists_every_registered_block() -> None:
    """Each kind's row of the table in docs/blocks.md names every block of the ``blocks`` package registered under
    that kind (``models`` registers its converters in the same registry; they are in the families table)."""

    table = (ROOT / "docs" / "blocks.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| (.*) \|$", table, re.M)}
    missing = {kind: [n for n in blocks.names(kind) if f"`{n}`" not in rows.get(kind, "")
                      and getattr(blocks.get(kind, n), "__module__", "").startswith("blocks")]
               for kind in blocks.kinds()}
    assert len(rows) >= 12
    assert {k: v for k, v in missing.items() if v} == {}, "add these to the table of docs/blocks.md"


def test_the_readme_links_resolve() -> None:
    """The README is not part of the site (the strict build does not see it): its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    targets = [m[1] for m in re.finditer(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://|#", m[1])]
    assert len(targets) >= 10
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert missing == []
