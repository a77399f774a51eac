"""The engine's decoding steps compiled ahead of time, in another process (``Engine(compile="aot")``).

``torch.compile`` in the engine process costs memory that stays: the compiler's modules (dynamo, inductor, sympy:
~110 MiB), what the compiled graphs keep (guards, shape environments, generated code: ~76 MiB on a 30-layer model),
and the fragmented arenas of a cold compile (docs/engine-performance.md). Here the decode-only steps of
``serving.runner`` (one decoding row: ``serving.single_row``; several: ``serving.runner.DynamicStep``; and
``serving.aot_export.WIDE_ROWS`` or more, their products through oneDNN: ``serving.aot_export``) are exported
(``torch.export``, their row, entry and pool-block counts dynamic) and compiled by AOTInductor
(``torch._inductor.aoti_compile_and_package``) in a child process (``serving.aot_export``).
The engine process loads the packages through ``torch._C._aoti.AOTIModelPackageLoader`` (C++: no compiler imported)
and hands them its own weights in place (user-managed constants: no copy), so it holds the eager engine's memory
plus the generated kernels.

- The child rebuilds the model from its class and config (no weights are read or sent) and checks that its
  tensors' names, shapes and dtypes are the engine model's (``serving.aot_export.tensor_signature``): a model its
  config does not describe (LoRA slots, quantized linears; latent attention's paged cache, found before: see
  ``exportable``) is not exported, and the runner compiles in-process instead, as ``compile=True`` does.
- Until the packages are ready the engine runs those steps eagerly; the child compiles at a low priority on one
  thread (a 30-layer model: ~2.5 minutes per step on one core). Packages are kept on disk by a key of everything
  the graph depends on (``package_key``): a later engine of the same model loads them at once.
- A package's first step is checked against the eager step's logits; one that differs is dropped (eager from then
  on, with a warning).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import blocks
import models
from blocks.paged_cache import PagedLayerCache
from blocks.prepacked_linear import PrepackedLinear

from .aot_export import KINDS, NOT_EXPORTABLE, step_inputs, tensor_signature

log = logging.getLogger(__name__)

#: Modules whose tensors a model's config does not describe (LoRA slots, adapters, quantized layers).
OWN_TENSORS = ("blocks.multi_lora", "blocks.adapters", "blocks.quantized", "blocks.lora_kernels")
#: The module whose ``main`` the compile process runs.
COMPILER = "serving.aot_export"
#: How close a package's logits must be to the eager step's on its first step (float32 reordering is ~1e-5).
TOLERANCE = 1e-3


def cache_dir() -> Path:
    """Where packages are kept: ``$ZOO_AOT_CACHE``, else ``$XDG_CACHE_HOME/transformer-zoo/aot`` (default
    ``~/.cache``).

    Returns:
        The folder (not created).
    """
    if os.environ.get("ZOO_AOT_CACHE"):
        return Path(os.environ["ZOO_AOT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "transformer-zoo" / "aot"


def exportable(model: nn.Module) -> str | None:
    """Why ``model`` cannot be compiled ahead of time, found without building anything (the compile process checks
    the rest: ``tensor_signature``), or None: on the CPU, every layer's attention on the plain paged cache, no LoRA
    slots (forward hooks), adapters or quantized layers.

    Args:
        model: the engine's ``DecoderLM`` (after any LoRA slots were added).

    Returns:
        The reason, or None.
    """
    if any(t.device.type != "cpu" for t in (*model.parameters(), *model.buffers())):
        return "the model is not on the CPU"
    if any(getattr(layer.self_attn, "paged_cache_kind", "paged") != "paged" for layer in model.layers):
        return "latent attention has its own paged cache"
    for name, module in model.named_modules():
        if type(module).__module__.startswith(OWN_TENSORS):
            return f"its {type(module).__name__} layers are not built from its config"
        if module._forward_hooks or module._forward_pre_hooks:  # LoRA slot banks hook the layers they adapt
            return f"{name or 'the model'} has forward hooks (LoRA slots), which its config does not build"
    return None


def prepacked(model: nn.Module) -> list[str]:
    """The layers of ``model`` that were prepacked (``blocks.prepacked_linear``): the compile process prepacks the
    same layers of the model it rebuilds, so that their tensors match.

    Args:
        model: the engine's model.

    Returns:
        The names of its ``PrepackedLinear`` layers.
    """
    return [name for name, module in model.named_modules() if isinstance(module, PrepackedLinear)]


def source_digest() -> str:
    """A digest of the code a step's graph is traced from: the ``blocks`` and ``models`` packages and this one.

    Returns:
        The hex digest.
    """
    digest = hashlib.sha256()
    roots = [Path(blocks.__file__).parent, Path(models.__file__).parent]
    files = sorted(p for root in roots for p in root.rglob("*.py"))
    here = Path(__file__).parent
    for path in [*files, *(here / name for name in ("aot_steps.py", "aot_export.py", "single_row.py"))]:
        digest.update(str(path.name).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def package_key(model: nn.Module, block_size: int, float_dtype: torch.dtype,
                kv_dtype: torch.dtype | None = None) -> str:
    """The key of a model's packages: what the graphs depend on (the code, torch's version and the CPU's vector
    ISA, the model's class, config and tensors, the block size, the pools' dtype, and the thread count: inductor
    writes its kernels' parallel loops for the threads of the process they are compiled for).

    Args:
        model: the engine's model.
        block_size: positions per block.
        float_dtype: its float dtype.
        kv_dtype: the pools' dtype, or None (or ``float_dtype``) for the model's.

    Returns:
        A hex key (a folder name).
    """
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else repr(model.config)
    parts = [source_digest(), torch.__version__, torch.backends.cpu.get_cpu_capability(),
             f"{type(model).__module__}.{type(model).__qualname__}", json.dumps(config, sort_keys=True, default=str),
             repr(tensor_signature(model)), block_size, str(float_dtype), torch.get_num_threads()]
    if kv_dtype not in (None, float_dtype):  # pools in the model's own dtype: the graphs of None
        parts.append(str(kv_dtype))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _die_with_parent() -> None:
    """Kill the compile process when the engine's process goes (Linux: ``PR_SET_PDEATHSIG``), and lower its
    priority under the engine's."""
    os.nice(10)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class PackagedStep:
    """A compiled package run as ``serving.runner.packed_logits`` on a decode-only step (the batch built with
    ``decode="ragged"``), the engine model's tensors handed to it in place.

    Args:
        path: the ``.pt2`` package.
        model: the engine's model (its parameters and buffers become the package's constants, not copied).
    """

    def __init__(self, path: Path, model: nn.Module) -> None:
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)
        named = {**dict(model.named_parameters(remove_duplicate=False)),
                 **dict(model.named_buffers(remove_duplicate=False))}
        constants = {fqn: named[fqn.removeprefix("model.")] for fqn in self.loader.get_constant_fqns()}
        self.loader.load_constants(constants, False, True, True)  # user-managed: the tensors are used in place
        self.calls, self.checked = 0, False

    def __call__(self, model: Any, ids: Tensor, positions: Tensor, caches: list[PagedLayerCache],
                 keep: Tensor) -> Tensor:
        self.calls += 1
        return self.loader.run(step_inputs(ids, positions, keep, caches))[0]


class AheadOfTimeSteps:
    """The packages of one runner: started in a child process if not on disk, loaded once they are.

    Args:
        model: the engine's ``DecoderLM``.
        block_size: positions per block.
        float_dtype: its float dtype.
        kv_dtype: the pools' dtype, or None for the model's.
    """

    def __init__(self, model: nn.Module, block_size: int, float_dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.folder = cache_dir() / package_key(model, block_size, float_dtype, kv_dtype)
        self.steps: dict[str, PackagedStep] = {}
        self.failed: str | None = None
        #: the compile process found the model's tensors are not those its config builds
        self.unexportable = False
        self.process: subprocess.Popen | None = None
        if all((self.folder / f"{kind}.pt2").exists() for kind in KINDS):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        spec = {"model_class": type(model), "config": model.config, "dtype": float_dtype, "block_size": block_size,
                "kv_dtype": kv_dtype, "prepacked": prepacked(model),
                "threads": torch.get_num_threads(),
                "signature": tensor_signature(model), "folder": str(self.folder),
                "buffers": {name: b.detach().clone() for name, b in model.named_buffers(remove_duplicate=False)}}
        handle, spec_path = tempfile.mkstemp(suffix=".spec", dir=self.folder)
        with os.fdopen(handle, "wb") as file:
            torch.save(spec, file)
        self.log_path = self.folder / "compile.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).parents[1]), *sys.path] if p)}
        with open(self.log_path, "wb") as out:
            command = f"import sys; from {COMPILER} import main; sys.exit(main(sys.argv[1:]))"
            self.process = subprocess.Popen([sys.executable, "-c", command, spec_path], env=env,
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    @property
    def pending(self) -> bool:
        """The packages are still being compiled (not all loaded, and no failure)."""
        return self.failed is None and len(self.steps) < len(KINDS)

    def poll(self) -> dict[str, PackagedStep]:
        """Load the packages that are ready (a cheap check per step while some are not).

        Returns:
            The loaded steps by kind.
        """
        if not self.pending:
            return self.steps
        for kind in KINDS:
            path = self.folder / f"{kind}.pt2"
            if kind not in self.steps and path.exists():
                try:
                    self.steps[kind] = PackagedStep(path, self.model)
                except Exception as err:  # noqa: BLE001 - a package that does not load: eager from then on
                    self.fail(f"{path} did not load: {type(err).__name__}: {err}")
                    return self.steps
        if self.pending and self.process is not None and self.process.poll() is not None:
            missing = [kind for kind in KINDS if not (self.folder / f"{kind}.pt2").exists()]
            if missing:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.unexportable = self.process.returncode == NOT_EXPORTABLE
                self.fail(f"the compile process exited with {self.process.returncode} ({self.log_path}):\n{tail}")
        return self.steps

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compile process, then load the packages.

        Args:
            timeout: seconds to wait at most (None: no limit).

        Returns:
            Whether every package is loaded.

        Raises:
            subprocess.TimeoutExpired: the process is still compiling after ``timeout`` seconds.
        """
        if self.process is not None:
            self.process.wait(timeout)
        self.poll()
        return len(self.steps) == len(KINDS)

    def fail(self, reason: str) -> None:
        """Give the packages up: the steps they would run stay eager.

        Args:
            reason: what went wrong (logged as a warning).
        """
        log.warning("ahead-of-time compiled steps are not used: %s", reason)
        self.failed, self.steps = reason, {}

    def close(self) -> None:
        """Stop the compile process, if it is running."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def checked(step: PackagedStep, steps: AheadOfTimeSteps, logits: Tensor, reference: Tensor) -> bool:
    """Compare a package's first logits with the eager step's; a mismatch gives the packages up.

    Args:
        step: the package run.
        steps: the runner's packages.
        logits: the package's logits.
        reference: the eager step's logits on the same inputs.

    Returns:
        Whether they agree.

    Shapes: logits ``(R, V)``, reference ``(R, V)``.
    """
    step.checked = True
    finite = reference.isfinite()
    scale = float(reference[finite].abs().max()) if finite.any() else 1.0
    # (not torch.testing.assert_close: it imports sympy, 25 MiB of objects in the engine's process)
    error = float((logits - reference)[finite].abs().max()) if finite.any() else 0.0  # NaN if the package's is
    infinite = reference.isinf()
    same_non_finite = torch.equal(logits.isnan(), reference.isnan()) and torch.equal(logits.isinf(), infinite) \
        and torch.equal(logits[infinite], reference[infinite])
    if not (same_non_finite and error <= TOLERANCE * max(1.0, scale)):
        steps.fail(f"a package's logits differ from the eager step's by {error:.3g} (non-finite where eager's are "
                   f"finite: {int((finite & ~logits.isfinite()).sum())})")
        return False
    return True


