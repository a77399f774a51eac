"""Shared fixtures and the hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (set by ``make test``) is derandomized with no deadline.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)
settings.register_profile("dev", deadline=None, max_examples=25)
settings.register_profile("thorough", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # ``make test`` runs one pytest worker per core (pytest-xdist): one intra-op thread each, so two workers never
    # fight over the cores (a kernel whose second OpenMP thread is descheduled waits at every barrier).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same torch RNG state."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    faster for them, and immune to a busy machine where a second thread's kernels wait to be scheduled."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny ``transformers`` Llama checkpoint with a tokenizer and a chat template (``tests.tiny_checkpoint``),
    written once per session: what the fine-tuning and evaluation tests load into the zoo, TRL and lm-eval."""
    from tests.tiny_checkpoint import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
