"""Text corpora with no download: the Python standard library's own documentation, or the user's files.

The built-in corpus is every docstring of the standard library (modules, classes, functions) plus the
``pydoc`` topic pages — real English prose about programming that every Python installation carries.
It is collected by parsing the sources with ``ast`` (nothing is imported or executed) and cached as JSONL
under ``$TZOO_CACHE``, ``$XDG_CACHE_HOME/transformer-zoo`` or ``~/.cache/transformer-zoo``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

CORPUS_VERSION = 1
MIN_WORDS = 8
# Folders of the standard library that hold tests, vendored wheels or demo scripts rather than documentation.
_SKIP_PARTS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "turtledemo", "_bundled", "__pycache__"}
_BLANK_LINES = re.compile(r"\n\s*\n")


def cache_dir() -> Path:
    """Where the built-in corpus is cached (created on first use).

    Returns:
        The cache folder.
    """
    if os.environ.get("TZOO_CACHE"):
        return Path(os.environ["TZOO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transformer-zoo"


def stdlib_docstrings(*, cache: bool = True, stdlib: str | Path | None = None) -> list[str]:
    """The built-in corpus: standard-library docstrings and pydoc topics, one document each.

    Args:
        cache: read/write the JSONL cache (the first collection parses ~600 files, several seconds).
        stdlib: the standard-library folder to read (default: this interpreter's).

    Returns:
        Documents in a fixed order (by file, then position), deduplicated, each at least ``MIN_WORDS`` words.

    Raises:
        FileNotFoundError: ``stdlib`` is not a folder.
    """
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard-library folder {str(root)!r} does not exist")
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    where = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:10]
    cache_file = cache_dir() / f"stdlib-docstrings-v{CORPUS_VERSION}-{version}-{where}.jsonl"
    if cache and cache_file.is_file():
        return read_jsonl(cache_file)
    docs = _collect(root)
    if cache:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        os.replace(tmp, cache_file)  # atomic: a concurrent reader never sees half a file
    return docs


def _collect(root: Path) -> list[str]:
    docs: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_PARTS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are templates or use other encodings; they hold no prose we need
        if path.relative_to(root).parts == ("pydoc_data", "topics.py"):
            docs.extend(_pydoc_topics(tree))
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    docs.append(doc)
    seen: set[str] = set()
    kept = []
    for doc in docs:
        doc = doc.strip()
        if len(doc.split()) >= MIN_WORDS and doc not in seen:
            seen.add(doc)
            kept.append(doc)
    return kept


def _pydoc_topics(tree: ast.Module) -> list[str]:
    """The string values of ``topics = {...}`` in ``pydoc_data/topics.py`` (the help() pages)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            return [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def read_jsonl(path: str | Path, text_field: str = "text") -> list[str]:
    """The ``text_field`` of every line of a JSONL file.

    Args:
        path: the file.
        text_field: the key holding each document's text.

    Returns:
        The documents.

    Raises:
        ValueError: a line that is not a JSON object with a string ``text_field`` (its number is named).
    """
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested too deeply
                raise ValueError(f"{path}:{number} is not valid JSON: {type(err).__name__}: {err}") from err
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{number} has no string field {text_field!r}")
            docs.append(record[text_field])
    return docs


def read_text(path: str | Path) -> list[str]:
    """Documents of a plain-text file: its paragraphs, separated by blank lines.

    Args:
        path: the file.

    Returns:
        The paragraphs.
    """
    text = Path(path).read_text(encoding="utf-8")
    return [p.strip() for p in _BLANK_LINES.split(text) if p.strip()]


def load_corpus(paths: str | Path | Sequence[str | Path] | None = None, *, text_field: str = "text") -> list[str]:
    """Documents to train on: the built-in corpus, or the user's files instead.

    Args:
        paths: None for ``stdlib_docstrings()``; else one path or several: ``.jsonl`` files (one JSON object
            per line, text in ``text_field``) or plain-text files (one document per paragraph).
        text_field: the JSONL field holding the text.

    Returns:
        The documents, in file order.

    Raises:
        FileNotFoundError: a missing file.
        ValueError: malformed JSONL, or files with no text at all.
    """
    if paths is None:
        return stdlib_docstrings()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"corpus file(s) not found: {missing}")
    docs: list[str] = []
    for p in paths:
        docs.extend(read_jsonl(p, text_field) if str(p).endswith(".jsonl") else read_text(p))
    if not docs:
        raise ValueError(f"no text found in {[str(p) for p in paths]}")
    return docs


def split_corpus(docs: Sequence[str], val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """A train/validation split decided by each document's hash, so it is the same on every machine and
    does not depend on document order.

    Args:
        docs: the documents.
        val_fraction: the expected share of validation documents, in (0, 1).

    Returns:
        ``(train, validation)``.

    Raises:
        ValueError: ``val_fraction`` outside (0, 1), or a split that leaves either side empty.
    """
    if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    train, val = [], []
    for doc in docs:
        bucket = int.from_bytes(hashlib.sha1(doc.encode("utf-8")).digest()[:8], "big") / 2**64
        (val if bucket < val_fraction else train).append(doc)
    if not train or not val:
        raise ValueError(
            f"splitting {len(docs)} document(s) with val_fraction={val_fraction} left the "
            f"{'training' if not train else 'validation'} side empty; give more documents"
        )
    return train, val
