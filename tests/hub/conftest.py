"""Fixtures for the Hub tests: an in-process Hub server with ``huggingface_hub`` pointed at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest

from .hub_server import DUMMY_TOKEN, HubServer, point_huggingface_hub_at


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A fresh Hub on 127.0.0.1; ``huggingface_hub`` talks to it, caches under a temporary ``HF_HOME`` and
    authenticates with a dummy ``HF_TOKEN``. Nothing leaves the machine."""
    server = HubServer(token=DUMMY_TOKEN).start()
    point_huggingface_hub_at(server, tmp_path / "hf_home", monkeypatch)
    try:
        yield server
    finally:
        huggingface_hub.close_session()  # drop keep-alive connections to this server before it goes away
        server.stop()
