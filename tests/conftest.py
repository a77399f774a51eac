"""Shared fixtures and the hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (set by ``make test``) is derandomized with no deadline.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
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

# Packages an engine compiles ahead of time (``Engine(compile="aot")``) go to a folder of this process, removed at exit,
# never to the user's cache.
if not os.environ.get("ZOO_AOT_CACHE"):
    os.environ["ZOO_AOT_CACHE"] = tempfile.mkdtemp(prefix="zoo-aot-test-")
    atexit.register(shutil.rmtree, os.environ["ZOO_AOT_CACHE"], ignore_errors=True)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # ``make test`` runs one pytest worker per core (pytest-xdist): one intra-op thread each, so two workers never
    # fight over the cores (a kernel whose second OpenMP thread is descheduled waits at every barrier).
    torch.set_num_threads(1)
    # Inductor compiles in the worker itself, not in a pool of compile processes (by default one per core, started
    # at a process's first compile: seconds of CPU to import torch in each, on cores the other worker is using).
    # The variable reaches the processes a test starts too (servers, scripts); the config is set as well in case
    # torch._inductor.config was imported before this line.
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    # The processes a test starts (servers, scripts, benchmarks' subprocesses) take one intra-op thread too, unless
    # told otherwise: two there would share a core with the other worker.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1


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


_KERNEL_BUILD: list[threading.Thread] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(session.config.option, "numprocesses", None):
        return
    # xdist's controller runs no test: it builds the GGUF CPU kernels (``blocks.quantized.cpu_kernels``: ~30 s of one
    # core in a new environment, a cache hit otherwise) while the workers start, instead of the first worker to need
    # them, with the other worker idle on the build's lock if it needs them meanwhile.
    from blocks.quantized import cpu_kernels

    _KERNEL_BUILD.append(threading.Thread(target=cpu_kernels.available, name="kernel-build", daemon=True))
    _KERNEL_BUILD[-1].start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for thread in _KERNEL_BUILD:
        thread.join()  # an interrupted build would leave its lock file behind


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
