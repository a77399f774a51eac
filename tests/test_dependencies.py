"""Missing test dependencies fail the suite instead of skipping tests: every distribution of the ``dev`` extra
(what ``make test`` installs) must be installed."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
DEV = [re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0] for req in PYPROJECT["project"]["optional-dependencies"]["dev"]]


def test_the_dev_extra_lists_the_reference_libraries() -> None:
    assert {"transformers", "peft", "gguf", "hypothesis", "import-linter"} <= set(DEV)


@pytest.mark.parametrize("distribution", DEV)
def test_every_test_dependency_is_installed(distribution: str) -> None:
    assert metadata.version(distribution)  # raises PackageNotFoundError when missing
