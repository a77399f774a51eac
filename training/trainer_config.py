"""``TrainerConfig``: what the training loop does, validated when it is built (a frozen dataclass of plain
values, stored in every checkpoint's trainer state)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch

from .parallel import MIXED_PRECISION, PARALLEL_MODES

__all__ = ["TrainerConfig"]


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What the training loop does.

    Attributes:
        max_steps: optimiser steps in the whole run (the progress bar's total).
        batch_size: examples per micro-batch on each data-parallel replica (tensor-parallel processes of one
            group share theirs).
        grad_accum_steps: micro-batches per optimiser step.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        eval_every: evaluate every N steps (None: only at the end, if there is evaluation data).
        eval_batch_size: examples per evaluation batch (default ``batch_size``).
        max_eval_batches: cap on evaluation batches (None: the whole evaluation set).
        checkpoint_dir: where checkpoint folders go.
        checkpoint_every: save every N steps (None: never on its own).
        keep_checkpoints: keep only the newest N checkpoint folders (None: keep all).
        shuffle: a fresh permutation of the training set per epoch.
        seed: seeds the data order and the evaluation randomness.
        progress: show the tqdm progress bar (main process only).
        device: "cpu", "cuda", "cuda:1" ... (default: this process's GPU if any, else the CPU).
        parallel: "ddp", "fsdp", "tp" or "fsdp+tp" (see ``training.parallel``); in one plain process every
            choice trains the whole model.
        tp_size: tensor-parallel processes per group ("tp": the world size; "fsdp+tp": required).
        mixed_precision: "bf16" or "fp16" compute with fp32 master weights and gradient reduction (FSDP only).
        activation_checkpointing: recompute each layer's activations in the backward pass.
    """

    max_steps: int
    batch_size: int = 32
    grad_accum_steps: int = 1
    max_grad_norm: float | None = 1.0
    eval_every: int | None = None
    eval_batch_size: int | None = None
    max_eval_batches: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int | None = None
    shuffle: bool = True
    seed: int = 0
    progress: bool = True
    device: str | None = None
    parallel: str = "ddp"
    tp_size: int | None = None
    mixed_precision: str | None = None
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum_steps"):
            _check_int(self, name, minimum=1)
        for name in ("eval_every", "eval_batch_size", "max_eval_batches", "checkpoint_every", "keep_checkpoints",
                     "tp_size"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=1)
        _check_int(self, "seed", minimum=0)
        for name in ("shuffle", "progress", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not math.isfinite(norm) or norm <= 0):
            raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {norm!r}")
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)):
                raise ValueError(f"checkpoint_dir must be a folder path or None, got {self.checkpoint_dir!r}")
            object.__setattr__(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))  # plain data in checkpoints
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        if self.device is not None:
            if not isinstance(self.device, str):
                raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {self.device!r}")
            try:
                torch.device(self.device)
            except RuntimeError as err:
                raise ValueError(f"device {self.device!r} is not a torch device: {err}") from err
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {sorted(MIXED_PRECISION)} or None, "
                             f"got {self.mixed_precision!r}")
        if self.tp_size not in (None, 1) and self.parallel not in ("tp", "fsdp+tp"):
            raise ValueError(f"tp_size={self.tp_size} needs parallel='tp' or 'fsdp+tp', got {self.parallel!r}")
        if self.parallel == "fsdp+tp" and self.tp_size is None:
            raise ValueError("parallel='fsdp+tp' needs tp_size")


def _check_int(config: Any, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
