"""Fixtures for the Hub tests: an in-process Hub server with ``huggingface_hub`` pointed at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from .hub_server import HubServer

DUMMY_TOKEN = "hf_transformerzoo_dummy_token_0123456789"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A fresh Hub on 127.0.0.1; ``huggingface_hub`` talks to it, caches under a temporary ``HF_HOME`` and
    authenticates with a dummy ``HF_TOKEN``. Nothing leaves the machine."""
    home = tmp_path / "hf_home"
    server = HubServer(token=DUMMY_TOKEN).start()
    # huggingface_hub reads these at import time, so the environment alone is not enough.
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_XET_CACHE", str(home / "xet"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setenv("HF_TOKEN", DUMMY_TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # no user-agent lookups against the Hub
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    try:
        yield server
    finally:
        huggingface_hub.close_session()  # drop keep-alive connections to this server before it goes away
        server.stop()
