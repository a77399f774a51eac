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


def test_each_zoo_row_is_compared_with_the_peer_of_its_caches_precision() -> None:
    f16, f32 = {"concurrent": 1.0}, {"concurrent": 2.0}
    both = {"llama-server": f16, "llama-server (kv f32)": f32}
    assert serve_peer.peer_of(both, "float16") is f16
    assert serve_peer.peer_of(both, "auto") is f32 and serve_peer.peer_of(both, "float32") is f32
    assert serve_peer.peer_of({"llama-server": f16}, "auto") is f16  # only the default peer was run
    assert serve_peer.peer_of({"llama-server (kv f32)": f32}, "float16") is None
    assert serve_peer.peer_of({}, "auto") is None


def test_the_peer_is_started_with_the_cache_type_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    class Process:
        pid = 1

        def __init__(self, argv: list[str], **kwargs: object) -> None:
            seen.append(argv)

        def poll(self) -> None:
            return None

        def terminate(self) -> None:
            pass

        def wait(self, timeout: float) -> int:
            return 0

    monkeypatch.setattr(serve_peer.subprocess, "Popen", Process)
    monkeypatch.setattr(serve_peer, "wait_healthy", lambda url, alive: None)
    with serve_peer.llama_server("llama-server", "m.gguf", 1, 16, 128, "f32"):
        pass
    argv = seen[0]
    assert argv[argv.index("-ctk") + 1] == argv[argv.index("-ctv") + 1] == "f32"
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == str(16 * 128)
