"""Single-file checkpoint formats (GGUF): a registry from a file ending to a reader that turns the file into a
``transformers`` config, state dict and tokenizer, which ``models.checkpoints.loading`` then converts like any
``transformers`` checkpoint.

A format module registers itself (``models.gguf`` calls ``register_file_format(".gguf", ...)``), so the loader
imports none of them. ``models.checkpoints.loading`` re-exports ``FileFormat`` and ``register_file_format``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class FileFormat:
    """A single-file checkpoint format that reads as a ``transformers`` checkpoint (see ``register_file_format``).

    Attributes:
        name: the format's name in messages (``"GGUF"``).
        read: ``read(path, dtype, keep_packed) -> (transformers config dict, state dict under transformers names,
            tokenizer or None)``.
        requires: what reading needs (``"pip install 'transformer-zoo[gguf]'"``), named when ``read`` raises
            ``ImportError``.
    """

    name: str
    read: Callable[[Path, torch.dtype | None, bool], tuple[Mapping[str, Any], Mapping[str, Tensor], Any]]
    requires: str


_FILE_FORMATS: dict[str, FileFormat] = {}


def register_file_format(
    suffix: str, name: str,
    read: Callable[[Path, torch.dtype | None, bool], tuple[Mapping[str, Any], Mapping[str, Tensor], Any]],
    requires: str,
) -> None:
    """Load local files ending in ``suffix`` with ``read(path, dtype, keep_packed) -> (transformers config dict,
    state dict under transformers names, tokenizer or None)``, converted like a ``transformers`` checkpoint.
    ``keep_packed``: quantized tensors may come as ``blocks.quantized.PackedWeight`` stand-ins (loaded packed).
    ``models.gguf`` registers ``".gguf"``; the format module registers itself, so the loader imports none of them.

    Args:
        suffix: the file ending, with its dot (``".gguf"``), matched case-insensitively.
        name: the format's name in messages (``"GGUF"``).
        read: the reader.
        requires: what loading needs, named when ``read`` raises ``ImportError``.

    Raises:
        ValueError: another format holds ``suffix``.
    """
    suffix = suffix.lower()
    old = _FILE_FORMATS.get(suffix)
    if old is not None and old.name != name:
        raise ValueError(f"files ending in {suffix!r} are already read as {old.name}; cannot register {name} for them")
    _FILE_FORMATS[suffix] = FileFormat(name, read, requires)


def single_file(path_or_repo_id: Any) -> tuple[Path, FileFormat] | None:
    """The path and its format when ``path_or_repo_id`` names a local file of a registered format, else ``None``.

    Args:
        path_or_repo_id: what ``from_pretrained`` was given (a path, a Hub repo id, or anything else).

    Returns:
        ``(path, format)``, or None for a folder, a repo id or a name without a registered ending.

    Raises:
        FileNotFoundError: a name ending in a registered suffix that is no file (such files load from local paths
            only).
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)):
        return None
    path = Path(path_or_repo_id).expanduser()
    file_format = _FILE_FORMATS.get(path.suffix.lower())
    if file_format is None or path.is_dir():
        return None
    if not path.is_file():
        name = file_format.name
        raise FileNotFoundError(f"no {name} file at {path}; {name} checkpoints are loaded from a local file path")
    return path, file_format


def read_single_file(
    path: Path, file_format: FileFormat, dtype: torch.dtype | None, keep_packed: bool
) -> tuple[dict[str, Any], dict[str, Tensor], Any]:
    """Read a single-file checkpoint with its format's reader.

    Args:
        path: the file (``single_file``).
        file_format: its format.
        dtype: the dtype the tensors are read in, or None to keep the file's.
        keep_packed: quantized tensors may come as ``blocks.quantized.PackedWeight`` stand-ins.

    Returns:
        The ``transformers`` config dict, the state dict under ``transformers`` names, and the tokenizer or None.

    Shapes: each tensor in the shape its ``transformers`` name has there.

    Raises:
        ImportError: the format's packages are not installed (what it ``requires`` is named).
    """
    try:
        hf_config, state, tokenizer = file_format.read(path, dtype, keep_packed)
    except ImportError as e:  # the format's packages are an optional extra
        raise ImportError(f"loading {path} needs {file_format.requires}: {e}") from e
    return dict(hf_config), dict(state), tokenizer
