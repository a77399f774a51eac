"""Serving tests run tiny models: one intra-op thread is faster for them, and immune to a busy machine (an engine
process takes as many threads as the test process that starts it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def failing_on(build: Callable[[], Any], trigger: int) -> Any:
    """``build()``'s model, whose forward raises ``RuntimeError("kernel exploded")`` on a batch holding the token id
    ``trigger`` (a picklable model factory for an engine process: one request makes its engine step fail)."""
    model = build()

    def refuse(module: Any, args: tuple) -> None:
        if bool((args[0] == trigger).any()):
            raise RuntimeError("kernel exploded")

    model.embed_tokens.register_forward_pre_hook(refuse)
    return model
