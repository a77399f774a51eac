"""``benchmarks.serve_peer``: how the llama-server peer is found (flag, environment, ``PATH``), and what is refused.

(The script itself runs in ``python -m benchmarks.serve_peer --quick``; it needs a built llama-server for its peer.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from benchmarks import serve_peer


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_llama_server_takes_the_flag_then_the_environment_then_path(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    flag, env, on_path = (_executable(tmp_path / name) for name in ("flag", "env", "llama-server"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("LLAMA_SERVER", str(env))
    assert serve_peer.find_llama_server(str(flag)) == str(flag)
    assert serve_peer.find_llama_server(None) == str(env)
    monkeypatch.delenv("LLAMA_SERVER")
    assert serve_peer.find_llama_server(None) == str(on_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert serve_peer.find_llama_server(None) is None


def test_find_llama_server_refuses_what_is_not_an_executable(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    plain = tmp_path / "llama-server"
    plain.write_text("")
    with pytest.raises(FileNotFoundError, match="not an executable"):
        serve_peer.find_llama_server(str(plain))
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        serve_peer.find_llama_server(None)
    assert os.access(tmp_path, os.X_OK)  # a folder is no binary either
    with pytest.raises(FileNotFoundError):
        serve_peer.find_llama_server(str(tmp_path))
