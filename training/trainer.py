"""``Trainer``: the training loop — gradient accumulation, clipping, evaluation, a progress bar,
checkpoints and exact resume, on one process or many (DDP).

Every optimiser step consumes ``grad_accum_steps`` micro-batches per process. The loss of a step is the
sum of per-token losses divided by the number of target tokens in the whole step (all micro-batches, all
processes), so accumulation and multi-process runs give the same update as one big batch.

A checkpoint folder ``step-NNNNNNNN`` holds ``model.safetensors`` (the weights), ``trainer_state.pt``
(optimizer, scheduler, step, data position, history; loaded with ``weights_only=True``) and one
``rng-rankR.pt`` per process. Loading one and training on gives the same losses as never stopping.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm.auto import tqdm

from .distributed import all_reduce_sum, barrier, get_rank, get_world_size, is_distributed, unwrap_model, wrap_model
from .losses import MaskedTokenLoss, TokenLoss
from .sampler import ResumableBatchSampler

CHECKPOINT_PREFIX = "step-"
_INPUT_KEYS = (("input_ids", "attention_mask"), ("src_ids", "src_mask"), ("tgt_ids", "tgt_mask"))


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What the training loop does.

    Attributes:
        max_steps: optimiser steps in the whole run (the progress bar's total).
        batch_size: examples per micro-batch on each process.
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

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum_steps"):
            _check_int(self, name, minimum=1)
        for name in ("eval_every", "eval_batch_size", "max_eval_batches", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=1)
        if self.max_grad_norm is not None and (not isinstance(self.max_grad_norm, (int, float))
                                               or self.max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        if self.device is not None:
            try:
                torch.device(self.device)
            except RuntimeError as err:
                raise ValueError(f"device {self.device!r} is not a torch device: {err}") from err


LossFunction = Callable[[nn.Module, Mapping[str, Any]], Tensor]


class Trainer:
    """Train ``model`` on ``train_data``.

    Args:
        model: a zoo model (or any module whose ``forward`` takes the collated batch).
        optimizer: over ``model``'s parameters.
        config: a ``TrainerConfig``.
        train_data: an indexable dataset (``len`` and ``[i]``); examples go through ``collate_fn``.
        collate_fn: list of examples -> batch dict of tensors (see ``training.collators``).
        scheduler: stepped after every optimiser step.
        eval_data, eval_collate_fn: the evaluation set and its collator (default ``collate_fn``).
        loss_fn: an object with ``count(batch) -> int`` (target tokens) and ``(model, batch) -> summed
            loss``; default ``TokenLoss`` with ``shift=True`` for ``DecoderLM`` (its labels are shifted
            inside the model) and aligned labels otherwise.
        eval_loss_fn: the evaluation loss (default: ``loss_fn`` without label smoothing).

    Raises:
        ValueError: a config that is not a ``TrainerConfig``, or a training set smaller than one global batch.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        config: TrainerConfig,
        train_data: Sequence[Any],
        collate_fn: Callable[[list[Any]], Mapping[str, Tensor]],
        *,
        scheduler: LRScheduler | None = None,
        eval_data: Sequence[Any] | None = None,
        eval_collate_fn: Callable[[list[Any]], Mapping[str, Tensor]] | None = None,
        loss_fn: TokenLoss | Any | None = None,
        eval_loss_fn: TokenLoss | Any | None = None,
    ) -> None:
        if not isinstance(config, TrainerConfig):
            raise ValueError(f"config must be a TrainerConfig, got {type(config).__name__}")
        self.config = config
        self.rank, self.world_size = get_rank(), get_world_size()
        self.device = torch.device(config.device) if config.device else _default_device()
        self.model = model.to(self.device)
        self.wrapped = wrap_model(self.model, self.device)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.train_data, self.collate_fn = train_data, collate_fn
        self.eval_data, self.eval_collate_fn = eval_data, eval_collate_fn or collate_fn
        self.loss_fn = loss_fn if loss_fn is not None else default_loss(model)
        if eval_loss_fn is None and isinstance(self.loss_fn, TokenLoss):
            eval_loss_fn = copy.copy(self.loss_fn)  # the same loss without label smoothing: a true perplexity
            eval_loss_fn.label_smoothing = 0.0
        self.eval_loss_fn = eval_loss_fn if eval_loss_fn is not None else self.loss_fn
        self.sampler = ResumableBatchSampler(
            len(train_data), config.batch_size, shuffle=config.shuffle, seed=config.seed,
            rank=self.rank, world_size=self.world_size,
        )
        # The whole training position: optimiser steps done, and micro-batches consumed in the epoch.
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.history: list[dict[str, float]] = []
        self.eval_history: list[dict[str, float]] = []

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ training
    def train(self, until: int | None = None) -> list[dict[str, float]]:
        """Train from the current step to ``until`` (default ``config.max_steps``).

        Returns:
            The history: one ``{"step", "loss", "lr", "tokens"}`` per optimiser step since step 1
            (a resumed trainer carries the history of its checkpoint).

        Raises:
            ValueError: ``until`` beyond ``max_steps``.
            FloatingPointError: a non-finite loss (the weights are left as they were before that step).
        """
        cfg = self.config
        until = cfg.max_steps if until is None else until
        if isinstance(until, bool) or not isinstance(until, int) or not 0 <= until <= cfg.max_steps:
            raise ValueError(f"until must be an integer in [0, max_steps={cfg.max_steps}], got {until!r}")
        self.model.train()
        batches = self._train_batches()
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (cfg.progress and self.is_main))
        start, tokens_seen = time.perf_counter(), 0.0
        try:
            while self.step < until:
                record = self._train_step([self._to_device(next(batches)) for _ in range(cfg.grad_accum_steps)])
                tokens_seen += record["tokens"]
                rate = tokens_seen / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{rate:,.0f}",
                                refresh=False)
                bar.update(1)
                if self.eval_data is not None and cfg.eval_every and self.step % cfg.eval_every == 0:
                    self._log_eval(bar)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
            done_eval = self.eval_history and self.eval_history[-1]["step"] == self.step
            if self.eval_data is not None and until == cfg.max_steps and not done_eval:
                self._log_eval(bar)
        finally:
            bar.close()
        return self.history

    def _train_step(self, micro_batches: list[Mapping[str, Tensor]]) -> dict[str, float]:
        # Count the step's target tokens everywhere first, so each micro-batch's summed loss can be scaled
        # to its exact share of the step's mean before its backward pass.
        local_targets = sum(self.loss_fn.count(b) for b in micro_batches)
        targets = all_reduce_sum(torch.tensor(float(local_targets), device=self.device)).item()
        # DDP averages gradients over processes; multiplying by world_size turns that into a sum.
        scale = self.world_size / max(targets, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or not is_distributed() else self.wrapped.no_sync()
            with sync:
                loss = self.loss_fn(self.wrapped, batch)
                (loss * scale).backward()
            loss_sum += loss.detach().float()
        tokens = float(sum(_input_tokens(b) for b in micro_batches))
        stats = all_reduce_sum(torch.stack([loss_sum, torch.tensor(tokens, device=self.device)]))
        loss_value = stats[0].item() / max(targets, 1.0)
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"loss is {loss_value} at step {self.step + 1}; the step was not applied")
        if self.config.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        record = {"step": self.step, "loss": loss_value, "lr": lr, "tokens": stats[1].item()}
        self.history.append(record)
        return record

    def _train_batches(self) -> Iterator[Mapping[str, Tensor]]:
        """Collated micro-batches from the saved position on; the position counts what was handed out."""
        while True:
            for indices in self.sampler.epoch_batches(self.epoch, start=self.batch_in_epoch):
                self.batch_in_epoch += 1
                yield self.collate_fn([self.train_data[i] for i in indices])
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def _to_device(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Mean per-token loss and perplexity on the evaluation set (all processes share the work).

        Randomness inside (e.g. MLM masking) is seeded from ``config.seed`` in a forked RNG, so every
        evaluation sees the same batches and the training RNG is left untouched.

        Returns:
            ``{"step", "loss", "perplexity"}``.

        Raises:
            ValueError: no evaluation data.
        """
        if self.eval_data is None:
            raise ValueError("no eval_data was given to the Trainer")
        cfg = self.config
        size = cfg.eval_batch_size or cfg.batch_size
        starts = list(range(0, len(self.eval_data), size))[: cfg.max_eval_batches]
        was_training = self.model.training
        self.model.eval()
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        totals = torch.zeros(2, device=self.device)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(cfg.seed)
            for lo in starts[self.rank:: self.world_size]:
                examples = [self.eval_data[i] for i in range(lo, min(lo + size, len(self.eval_data)))]
                batch = self._to_device(self.eval_collate_fn(examples))
                totals[0] += self.eval_loss_fn(self.model, batch).float()
                totals[1] += self.eval_loss_fn.count(batch)
        self.model.train(was_training)
        loss_sum, count = all_reduce_sum(totals).tolist()
        loss = loss_sum / max(count, 1.0)
        result = {"step": self.step, "loss": loss, "perplexity": math.exp(min(loss, 700.0))}
        return result

    def _log_eval(self, bar: tqdm) -> None:
        result = self.evaluate()
        self.eval_history.append(result)
        if self.is_main and self.config.progress:
            bar.write(f"step {result['step']}: eval loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Write a checkpoint of the current step into ``directory`` (default ``config.checkpoint_dir``).

        The folder appears atomically (written under a temporary name, then renamed); with
        ``keep_checkpoints`` older folders are removed.

        Returns:
            The checkpoint folder ``<directory>/step-NNNNNNNN``.

        Raises:
            ValueError: no directory given or configured.
        """
        target = directory if directory is not None else self.config.checkpoint_dir
        if target is None:
            raise ValueError("no checkpoint directory: pass one or set TrainerConfig.checkpoint_dir")
        root = Path(target)
        final = root / f"{CHECKPOINT_PREFIX}{self.step:08d}"
        tmp = root / f".{final.name}.tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        torch.save(_rng_state(), tmp / f"rng-rank{self.rank}.pt")
        if self.is_main:
            safetensors.torch.save_model(self.model, str(tmp / "model.safetensors"))
            torch.save({
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "world_size": self.world_size,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "history": self.history,
                "eval_history": self.eval_history,
                "config": dataclasses.asdict(self.config),
            }, tmp / "trainer_state.pt")
        barrier()
        if self.is_main:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            if self.config.keep_checkpoints:
                for old in list_checkpoints(root)[: -self.config.keep_checkpoints]:
                    shutil.rmtree(old)
        barrier()
        return final

    def load_checkpoint(self, path: str | Path = "latest") -> Path:
        """Restore weights, optimiser, scheduler, RNG and data position from a checkpoint folder.

        Args:
            path: a checkpoint folder, or "latest" for the newest one in ``config.checkpoint_dir``.

        Returns:
            The folder loaded.

        Raises:
            FileNotFoundError: no such checkpoint.
            ValueError: it was written by a different number of processes (each keeps its own RNG).
        """
        if str(path) == "latest":
            found = list_checkpoints(self.config.checkpoint_dir) if self.config.checkpoint_dir else []
            if not found:
                raise FileNotFoundError(f"no checkpoint in checkpoint_dir={self.config.checkpoint_dir!r}")
            path = found[-1]
        path = Path(path)
        state_file, rng_file = path / "trainer_state.pt", path / f"rng-rank{self.rank}.pt"
        for f in (path / "model.safetensors", state_file):
            if not f.is_file():
                raise FileNotFoundError(f"{str(path)!r} is not a checkpoint folder: {f.name} is missing")
        state = torch.load(state_file, map_location=self.device, weights_only=True)
        if state["world_size"] != self.world_size or not rng_file.is_file():
            raise ValueError(
                f"checkpoint {str(path)!r} was written by {state['world_size']} process(es); resume it with the "
                f"same number (this run has {self.world_size}) so every process gets its own RNG state back"
            )
        safetensors.torch.load_model(self.model, str(path / "model.safetensors"), device=str(self.device))
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.history, self.eval_history = list(state["history"]), list(state["eval_history"])
        _set_rng_state(torch.load(rng_file, weights_only=True))
        return path


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint folders in ``directory``, oldest first (empty if there is none)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX))


def default_loss(model: nn.Module) -> TokenLoss:
    """Plain token cross-entropy: shifted for ``DecoderLM`` (its labels are the inputs themselves), on the
    labelled positions only for ``EncoderLM``, aligned for everything else."""
    from models import DecoderLM, EncoderLM

    inner = unwrap_model(model)
    if isinstance(inner, EncoderLM):
        return MaskedTokenLoss()
    return TokenLoss(shift=isinstance(inner, DecoderLM))


def _input_tokens(batch: Mapping[str, Any]) -> int:
    """Real input tokens of a batch (what tokens/s counts): masked entries of each id tensor."""
    total = 0
    for ids, mask in _INPUT_KEYS:
        if ids in batch:
            total += int(batch[mask].sum()) if mask in batch else batch[ids].numel()
    return total


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    """``random.setstate`` needs tuples all the way down; a round trip may hand back lists."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def _check_int(config: Any, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
