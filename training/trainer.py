"""``Trainer``: the training loop — gradient accumulation, clipping, evaluation, a progress bar,
checkpoints and exact resume, on one process or many (DDP, FSDP2, tensor parallel, FSDP + TP).

Every optimiser step consumes ``grad_accum_steps`` micro-batches per data-parallel replica. The loss of a
step is the sum of per-token losses divided by the number of target tokens in the whole step (all
micro-batches, all replicas), so accumulation and multi-process runs give the same update as one big batch.

The Trainer shards the model first and builds the optimiser afterwards, from a factory, over the
trainable parameters only (``requires_grad=True``), so the optimiser always holds what the processes
really own. Checkpoints (see ``training.checkpoint``) hold the trainable parameters, the optimiser,
scheduler, data position, history and random states; they load at another world size or layout and
are checked before anything is restored.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .checkpoint import CHECKPOINT_PREFIX, list_checkpoints
from .distributed import barrier, get_rank, get_world_size, is_distributed, unwrap_model
from .losses import MaskedTokenLoss, TokenLoss
from .parallel import (
    MIXED_PRECISION,
    PARALLEL_MODES,
    ParallelLayout,
    apply_parallelism,
    clip_grad_norm,
    is_dtensor,
    parallel_layout,
)
from .sampler import ResumableBatchSampler

__all__ = ["CHECKPOINT_PREFIX", "Trainer", "TrainerConfig", "default_loss", "list_checkpoints"]

_INPUT_KEYS = (("input_ids", "attention_mask"), ("src_ids", "src_mask"), ("tgt_ids", "tgt_mask"))


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


LossFunction = Callable[[nn.Module, Mapping[str, Any]], Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]
SchedulerFactory = Callable[[Optimizer], LRScheduler]


class Trainer:
    """Train ``model`` on ``train_data``.

    Args:
        model: a zoo model (or any module whose ``forward`` takes the collated batch).
        optimizer: a factory called with the list of trainable parameters once the model is sharded, e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-3)`` or ``lambda params: AdamW(decay_groups(params))``;
            an already built ``Optimizer`` is accepted where nothing is sharded (DDP or one process).
        config: a ``TrainerConfig``.
        train_data: an indexable dataset (``len`` and ``[i]``); examples go through ``collate_fn``.
        collate_fn: list of examples -> batch dict of tensors (see ``training.collators``).
        scheduler: a factory called with the optimiser (or, with a built optimiser, a scheduler over it);
            stepped after every optimiser step.
        eval_data, eval_collate_fn: the evaluation set and its collator (default ``collate_fn``).
        loss_fn: an object with ``count(batch) -> int`` (target tokens) and ``(model, batch) -> summed
            loss``; default ``TokenLoss`` with ``shift=True`` for ``DecoderLM`` (its labels are shifted
            inside the model) and aligned labels otherwise.
        eval_loss_fn: the evaluation loss (default: ``loss_fn`` without label smoothing).

    Raises:
        ValueError: a config that is not a ``TrainerConfig``, a training set smaller than one global batch, a
            bad parallel layout for this world size or model, a built optimiser where the model is sharded, an
            optimiser holding frozen or foreign parameters, or a scheduler of another optimiser.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerFactory,
        config: TrainerConfig,
        train_data: Sequence[Any],
        collate_fn: Callable[[list[Any]], Mapping[str, Tensor]],
        *,
        scheduler: LRScheduler | SchedulerFactory | None = None,
        eval_data: Sequence[Any] | None = None,
        eval_collate_fn: Callable[[list[Any]], Mapping[str, Tensor]] | None = None,
        loss_fn: TokenLoss | Any | None = None,
        eval_loss_fn: TokenLoss | Any | None = None,
    ) -> None:
        if not isinstance(config, TrainerConfig):
            raise ValueError(f"config must be a TrainerConfig, got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, Optimizer) and not callable(optimizer):
            raise ValueError(f"optimizer must be a factory (trainable parameters -> Optimizer) or an Optimizer, "
                             f"got {type(optimizer).__name__}")
        if isinstance(optimizer, Optimizer) and scheduler is not None and not isinstance(scheduler, LRScheduler):
            raise ValueError("with a built optimizer, pass a built scheduler (or pass factories for both)")
        if not isinstance(optimizer, Optimizer) and isinstance(scheduler, LRScheduler):
            raise ValueError("scheduler was built over another optimizer: pass a factory (optimizer -> scheduler) "
                             "so it wraps the optimizer the Trainer builds")
        self.config = config
        self.rank, self.world_size = get_rank(), get_world_size()
        dp_size, _ = parallel_layout(config.parallel, self.world_size, config.tp_size)
        # The sampler checks the data size before the model is touched.
        self.sampler = ResumableBatchSampler(len(train_data), config.batch_size, shuffle=config.shuffle,
                                             seed=config.seed, rank=0, world_size=dp_size)
        sharded = is_distributed() and config.parallel != "ddp"
        if isinstance(optimizer, Optimizer):
            if sharded:
                raise ValueError(
                    f"parallel={config.parallel!r} shards the model, so the optimizer must be built afterwards over "
                    f"the shards: pass a factory such as functools.partial(torch.optim.AdamW, lr=...) instead of an "
                    f"Optimizer"
                )
            _check_optimizer(optimizer, model)
        self.device = torch.device(config.device) if config.device else _default_device()
        self.model = model.to(self.device)
        self.wrapped, self.layout = apply_parallelism(
            self.model, config.parallel, self.device, tp_size=config.tp_size,
            mixed_precision=config.mixed_precision, activation_checkpointing=config.activation_checkpointing,
        )
        self.sampler.rank = self.layout.dp_rank
        if self.layout.tp_size > 1:
            _share_rng_in_tensor_parallel_group(self.layout)
        if isinstance(optimizer, Optimizer):
            self.optimizer = optimizer
        else:
            self.optimizer = optimizer([p for p in self.model.parameters() if p.requires_grad])
            if not isinstance(self.optimizer, Optimizer):
                raise ValueError(f"the optimizer factory returned a {type(self.optimizer).__name__}, not an Optimizer")
            _check_optimizer(self.optimizer, self.model)
        if scheduler is not None and not isinstance(scheduler, LRScheduler):
            scheduler = scheduler(self.optimizer)
            if not isinstance(scheduler, LRScheduler):
                raise ValueError(f"the scheduler factory returned a {type(scheduler).__name__}, not an LRScheduler")
        if scheduler is not None and scheduler.optimizer is not self.optimizer:
            raise ValueError("scheduler steps another optimizer than the one the Trainer uses")
        self.scheduler = scheduler
        self.train_data, self.collate_fn = train_data, collate_fn
        self.eval_data, self.eval_collate_fn = eval_data, eval_collate_fn or collate_fn
        self.loss_fn = loss_fn if loss_fn is not None else default_loss(model)
        if eval_loss_fn is None and isinstance(self.loss_fn, TokenLoss):
            eval_loss_fn = copy.copy(self.loss_fn)  # the same loss without label smoothing: a true perplexity
            eval_loss_fn.label_smoothing = 0.0
        self.eval_loss_fn = eval_loss_fn if eval_loss_fn is not None else self.loss_fn
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
            FloatingPointError: a non-finite loss or gradient norm (the weights are left as they were before
                that step).
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
        targets = self._replica_sum(torch.tensor(float(local_targets), device=self.device)).item()
        # DDP and FSDP average gradients over the data-parallel replicas; multiplying by their number turns that
        # into a sum (tensor-parallel peers do not average: they hold different slices of one gradient).
        scale = self.layout.dp_size / max(targets, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._gradient_sync(last):
                loss = self.loss_fn(self.wrapped, batch)
                (loss * scale).backward()
            loss_sum += loss.detach().float()
        tokens = float(sum(_input_tokens(b) for b in micro_batches))
        stats = self._replica_sum(torch.stack([loss_sum, torch.tensor(tokens, device=self.device)]))
        loss_value = stats[0].item() / max(targets, 1.0)
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"loss is {loss_value} at step {self.step + 1}; the step was not applied")
        if self.config.max_grad_norm is not None:
            norm = float(clip_grad_norm(self.model.parameters(), self.config.max_grad_norm))
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(f"gradient norm is {norm} at step {self.step + 1}; the step was not applied")
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        record = {"step": self.step, "loss": loss_value, "lr": lr, "tokens": stats[1].item()}
        self.history.append(record)
        return record

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Reduce gradients over the replicas only after the last micro-batch of a step."""
        if not is_distributed() or self.layout.dp_size == 1:
            return contextlib.nullcontext()
        if isinstance(self.wrapped, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext() if last else self.wrapped.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 keeps unsharded gradients until then
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _replica_sum(self, tensor: Tensor) -> Tensor:
        """Sum over the data-parallel replicas (not over tensor-parallel peers, which hold the same batch)."""
        if is_distributed() and self.layout.dp_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.layout.dp_group)
        return tensor

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
        """Mean per-token loss and perplexity on the evaluation set (the replicas share the work).

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
        mine = starts[self.layout.dp_rank:: self.layout.dp_size]
        # A sharded forward pass is a collective: every replica runs as many as the busiest one, the extra
        # ones on a batch whose result is dropped.
        rounds = math.ceil(len(starts) / self.layout.dp_size) if self.layout.sharded else len(mine)
        was_training = self.model.training
        self.model.eval()
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        totals = torch.zeros(2, device=self.device)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(cfg.seed)
            for r in range(rounds):
                lo = mine[r] if r < len(mine) else starts[0]
                examples = [self.eval_data[i] for i in range(lo, min(lo + size, len(self.eval_data)))]
                batch = self._to_device(self.eval_collate_fn(examples))
                loss = self.eval_loss_fn(self.model, batch).float()
                if r < len(mine):
                    totals[0] += loss
                    totals[1] += self.eval_loss_fn.count(batch)
        self.model.train(was_training)
        loss_sum, count = self._replica_sum(totals).tolist()
        loss = loss_sum / max(count, 1.0)
        return {"step": self.step, "loss": loss, "perplexity": math.exp(min(loss, 700.0))}

    def _log_eval(self, bar: tqdm) -> None:
        result = self.evaluate()
        self.eval_history.append(result)
        if self.is_main and self.config.progress:
            bar.write(f"step {result['step']}: eval loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}")

    # ------------------------------------------------------------------ exporting
    def save_pretrained(self, save_directory: str | os.PathLike[str], tokenizer: Any = None) -> Path:
        """Write the trained model as an ordinary consolidated checkpoint (``config.json``, one
        ``model.safetensors``, ...) with the model's own ``save_pretrained``, however it is sharded.

        Every process must call it (sharded parameters are gathered, a collective); the main process writes.

        Args:
            save_directory: the folder.
            tokenizer: saved along (see the model's ``save_pretrained``).

        Returns:
            The folder's path.

        Raises:
            ValueError: the model has no ``save_pretrained``.
        """
        model = unwrap_model(self.model)
        if not callable(getattr(model, "save_pretrained", None)):
            raise ValueError(f"{type(model).__name__} has no save_pretrained method")
        target = Path(save_directory)
        if not self.layout.sharded:
            if self.is_main:
                model.save_pretrained(target, tokenizer=tokenizer)
            barrier()
            return target
        full = consolidated_state_dict(model)
        if self.is_main:
            plain = _original_class(model)(model.config)
            plain.load_state_dict(full)
            plain.tokenizer = getattr(model, "tokenizer", None)
            plain.save_pretrained(target, tokenizer=tokenizer)
        barrier()
        return target

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | Path | None = None) -> Path:
        """Write a checkpoint of the current step into ``directory`` (default ``config.checkpoint_dir``).

        Every process writes its shards and random state; the folder appears by one rename once complete,
        and with ``keep_checkpoints`` older folders are removed. A kill at any moment leaves the previous
        checkpoints (and this one, once renamed) loadable.

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
        staging = ckpt.staging_folder(root, final.name)
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
            ckpt.recover(root)
            staging.mkdir()
        barrier()
        ckpt.save_torch(_rng_state(), staging / ckpt.rng_name(self.rank))
        ckpt.write_sharded(ckpt.sharded_state(self.model, self.optimizer), staging / ckpt.SHARDED_DIR)
        if self.is_main:
            ckpt.save_torch(self._trainer_state(), staging / ckpt.STATE_NAME)
        barrier()
        if self.is_main:
            ckpt.write_manifest(staging)
            ckpt.publish(staging, final)
            if self.config.keep_checkpoints:
                for old in list_checkpoints(root)[: -self.config.keep_checkpoints]:
                    ckpt.remove(old)
        barrier()
        return final

    def _trainer_state(self) -> dict[str, Any]:
        shapes = {name: list(p.shape) for name, p in self.model.named_parameters() if p.requires_grad}
        return {
            "format_version": ckpt.FORMAT_VERSION,
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "run": self._run_shape(),
            "trainable": shapes,
            "optimizer_class": _qualified_name(self.optimizer),
            "optimizer": ckpt.optimizer_skeleton(self.model, self.optimizer),
            "scheduler_class": None if self.scheduler is None else _qualified_name(self.scheduler),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "history": self.history,
            "eval_history": self.eval_history,
            "config": dataclasses.asdict(self.config),
        }

    def _run_shape(self) -> dict[str, Any]:
        """What a resume must agree with: the processes and how the data is cut."""
        cfg = self.config
        return {
            "world_size": self.world_size, "parallel": cfg.parallel, "dp_size": self.layout.dp_size,
            "tp_size": self.layout.tp_size, "batch_size": cfg.batch_size,
            "global_batch_size": cfg.batch_size * self.layout.dp_size, "grad_accum_steps": cfg.grad_accum_steps,
            "dataset_size": len(self.train_data), "shuffle": cfg.shuffle, "seed": cfg.seed,
        }

    def load_checkpoint(self, path: str | Path = "latest", *, allow_world_size_change: bool = False) -> Path:
        """Restore the trainable weights, optimiser, scheduler, random state and data position.

        Everything is checked first — the files against the manifest, the run's shape, the optimiser and
        scheduler classes, the parameter names and shapes — on every process; only then is anything
        restored, so a refused checkpoint leaves the trainer and the model as they were. The checkpoint may
        come from another parallel layout (DDP, FSDP, tensor parallel) with the same number of processes;
        frozen parameters are not in it and keep the values of the model given to the Trainer.

        Args:
            path: a checkpoint folder, or "latest" for the newest one in ``config.checkpoint_dir``.
            allow_world_size_change: resume a checkpoint written by another number of processes. The data
                position carries over in global batches (keep ``batch_size`` x data-parallel size the same);
                process ``r`` takes the random state of the saved process that read the same data slice
                (``r``'s data-parallel rank modulo the saved number of replicas), so deterministic training
                continues exactly, while random draws (dropout, MLM masking) differ from an uninterrupted run.

        Returns:
            The folder loaded.

        Raises:
            FileNotFoundError: no such checkpoint.
            ValueError: a damaged or missing file (each named), or a checkpoint that does not fit this run
                (what changed is said): another dataset length, global batch, accumulation, data order,
                world size (unless allowed), optimiser or scheduler class, or model.
        """
        if not isinstance(allow_world_size_change, bool):
            raise ValueError(f"allow_world_size_change must be True or False, got {allow_world_size_change!r}")
        path = self._resolve_checkpoint(path)
        try:
            problems, state, rng, metadata = self._check_checkpoint(path, allow_world_size_change)
        except Exception as err:  # a malformed state: reported, never left to hang the other processes
            problems, state, rng, metadata = [f"{path / ckpt.STATE_NAME} is malformed: {type(err).__name__}: {err}"], \
                None, None, None
        # Every process must agree before any collective load starts, or the healthy ones would wait forever.
        if is_distributed():
            gathered: list[list[str] | None] = [None] * self.world_size
            dist.all_gather_object(gathered, problems)
            problems = list(dict.fromkeys(p for ps in gathered for p in (ps or [])))
        if problems:
            raise ValueError(f"cannot resume from {str(path)!r}:\n  - " + "\n  - ".join(problems))
        assert state is not None and rng is not None and metadata is not None
        targets = self._load_targets(state, metadata)
        try:
            ckpt.load_sharded(targets, path / ckpt.SHARDED_DIR)
        except Exception as err:  # DCP wraps every process's failure; nothing has been restored yet
            raise ValueError(f"cannot read the sharded state in {path / ckpt.SHARDED_DIR}: {err}") from err
        self._restore(state, targets, rng)
        return path

    def _resolve_checkpoint(self, path: str | Path) -> Path:
        if self.is_main and self.config.checkpoint_dir:
            ckpt.recover(Path(self.config.checkpoint_dir))
        barrier()
        if str(path) == "latest":
            found = list_checkpoints(self.config.checkpoint_dir) if self.config.checkpoint_dir else []
            if not found:
                raise FileNotFoundError(f"no checkpoint in checkpoint_dir={self.config.checkpoint_dir!r}")
            return found[-1]
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"no checkpoint folder at {str(path)!r}")
        return path

    def _check_checkpoint(
        self, path: Path, allow_world_size_change: bool
    ) -> tuple[list[str], dict[str, Any] | None, dict[str, Any] | None, Any]:
        """``(problems, trainer state, this process's RNG state, DCP metadata)``; nothing is changed."""
        problems = ckpt.verify_manifest(path) if self.is_main else []
        if problems:
            return problems, None, None, None
        try:
            state = ckpt.load_torch(path / ckpt.STATE_NAME, "trainer state")
            if not isinstance(state, dict) or state.get("format_version") != ckpt.FORMAT_VERSION:
                raise ValueError(f"{path / ckpt.STATE_NAME} is not a trainer state of format {ckpt.FORMAT_VERSION}")
            metadata = ckpt.read_metadata(path / ckpt.SHARDED_DIR)
        except ValueError as err:
            return [str(err)], None, None, None
        problems = self._compare_run(state, allow_world_size_change)
        problems += self._compare_model(state, ckpt.tensor_shapes(metadata))
        saved = state["run"]
        rng_rank = (self.layout.dp_rank % saved["dp_size"]) * saved["tp_size"]
        if saved["world_size"] == self.world_size and saved["tp_size"] == self.layout.tp_size == 1:
            rng_rank = self.rank
        rng = None
        try:
            rng = ckpt.load_torch(path / ckpt.rng_name(rng_rank), f"random state of process {rng_rank}")
        except ValueError as err:
            problems.append(str(err))
        return problems, state, rng, metadata

    def _compare_run(self, state: dict[str, Any], allow_world_size_change: bool) -> list[str]:
        saved, now = state["run"], self._run_shape()
        problems = []
        if saved["world_size"] != now["world_size"] and not allow_world_size_change:
            problems.append(
                f"it was written by {saved['world_size']} process(es), this run has {now['world_size']}: pass "
                f"allow_world_size_change=True to resume anyway (the data position carries over; random draws such "
                f"as dropout then differ from an uninterrupted run)"
            )
        if saved["dataset_size"] != now["dataset_size"]:
            problems.append(f"the training set had {saved['dataset_size']} examples, now {now['dataset_size']}: the "
                            f"saved data position would point at other examples")
        if saved["global_batch_size"] != now["global_batch_size"]:
            problems.append(
                f"the global batch changed from {saved['global_batch_size']} (batch_size {saved['batch_size']} x "
                f"{saved['dp_size']} data-parallel replicas) to {now['global_batch_size']} (batch_size "
                f"{now['batch_size']} x {now['dp_size']}): the saved data position counts global batches"
            )
        for key in ("grad_accum_steps", "shuffle", "seed"):
            if saved[key] != now[key]:
                problems.append(f"{key} changed from {saved[key]!r} to {now[key]!r}")
        for kind, name in (("optimizer", _qualified_name(self.optimizer)),
                           ("scheduler", None if self.scheduler is None else _qualified_name(self.scheduler))):
            if state[f"{kind}_class"] != name:
                problems.append(f"the {kind} was {state[f'{kind}_class']}, now {name}")
        return problems

    def _compare_model(self, state: dict[str, Any], shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> list[str]:
        now = {name: list(p.shape) for name, p in self.model.named_parameters() if p.requires_grad}
        saved = state["trainable"]
        problems = []
        missing, extra = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
        if missing or extra:
            problems.append(f"the trainable parameters differ (another model, or other frozen parameters): "
                            f"not in the checkpoint {missing[:5]}, only in the checkpoint {extra[:5]}")
        wrong = [f"{n} {saved[n]} vs {now[n]}" for n in sorted(set(now) & set(saved)) if saved[n] != now[n]]
        if wrong:
            problems.append(f"parameters of another shape (another model): {', '.join(wrong[:5])}")
        stored = [n for n in now if f"model/{n}" not in shapes or list(shapes[f"model/{n}"][0]) != now[n]]
        if stored and not problems:
            problems.append(f"the sharded state lacks or mis-shapes {stored[:5]}")
        strangers = sorted({k[len("optim/"): k.rindex("/")] for k in shapes if k.startswith("optim/")} - set(now))
        if strangers and not problems:
            problems.append(f"the sharded optimizer state names parameters the model lacks: {strangers[:5]}")
        groups = [[n for n in g["params"]] for g in state["optimizer"]["param_groups"]]
        names = ckpt.trainable_names(self.model)
        current = [[names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        if groups != current:
            problems.append(f"the optimizer's parameter groups differ: {len(groups)} group(s) of "
                            f"{[len(g) for g in groups]} saved, {len(current)} of {[len(g) for g in current]} now")
        return problems

    def _load_targets(self, state: dict[str, Any], metadata: Any) -> dict[str, Tensor]:
        """Fresh tensors (sharded like the live ones) for DCP to fill, so a failed read changes nothing."""
        shapes = ckpt.tensor_shapes(metadata)
        targets: dict[str, Tensor] = {}
        params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        for name, p in params.items():
            targets[f"model/{name}"] = torch.empty_like(p.detach())
        for key, (shape, dtype) in shapes.items():
            if not key.startswith("optim/"):
                continue
            name = key[len("optim/"): key.rindex("/")]
            p = params[name]
            if list(shape) == list(p.shape):  # moments: sharded like their parameter
                targets[key] = torch.empty_like(p.detach(), dtype=dtype)
            else:  # scalars (Adam's step) and other small state: whole on every process
                targets[key] = torch.empty(shape, dtype=dtype, device=_local(p).device)
        return targets

    def _restore(self, state: dict[str, Any], targets: dict[str, Tensor], rng: dict[str, Any]) -> None:
        params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(targets[f"model/{name}"])
        index = {name: i for i, name in enumerate(n for g in state["optimizer"]["param_groups"] for n in g["params"])}
        per_param: dict[int, dict[str, Any]] = {}
        for key, value in targets.items():
            if key.startswith("optim/"):
                name, field = key[len("optim/"): key.rindex("/")], key[key.rindex("/") + 1:]
                per_param.setdefault(index[name], {})[field] = value
        for name, extra in state["optimizer"]["extra"].items():
            per_param.setdefault(index[name], {}).update(extra)
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["optimizer"]["param_groups"]]
        self.optimizer.load_state_dict({"state": per_param, "param_groups": groups})
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.history, self.eval_history = list(state["history"]), list(state["eval_history"])
        _set_rng_state(rng)


def consolidated_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's whole state dict on the CPU, gathered from every process's shards (a collective: every
    process calls it and gets the whole tensors).

    Shapes: each tensor has its unsharded (global) shape.
    """
    full: dict[str, Tensor] = {}
    gathered: dict[int, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if id(tensor) not in gathered:  # tied weights are gathered once
            whole = tensor.full_tensor() if is_dtensor(tensor) else tensor
            gathered[id(tensor)] = whole.detach().cpu()
        full[name] = gathered[id(tensor)]
    return full


def default_loss(model: nn.Module) -> TokenLoss:
    """Plain token cross-entropy: shifted for ``DecoderLM`` (its labels are the inputs themselves), on the
    labelled positions only for ``EncoderLM``, aligned for everything else."""
    from models import DecoderLM, EncoderLM

    inner = unwrap_model(model)
    if isinstance(inner, EncoderLM):
        return MaskedTokenLoss()
    return TokenLoss(shift=isinstance(inner, DecoderLM))


def _check_optimizer(optimizer: Optimizer, model: nn.Module) -> None:
    """The optimiser must step trainable parameters of ``model`` only."""
    own = {id(p): p for p in model.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = sum(id(p) not in own for p in params)
    frozen = sum(id(p) in own and not p.requires_grad for p in params)
    if foreign or frozen:
        raise ValueError(
            f"the optimizer holds {foreign} parameter(s) that are not the model's and {frozen} frozen one(s) "
            f"(requires_grad=False); build it over the model's trainable parameters (or pass a factory)"
        )


def _original_class(model: nn.Module) -> type:
    """The model's own class (FSDP2 swaps in a subclass ``FSDP<Name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _share_rng_in_tensor_parallel_group(layout: ParallelLayout) -> None:
    """Tensor-parallel peers must draw the same random numbers (dropout on the replicated residual stream):
    each takes its group's first process's generator state."""
    group = layout.mesh["tp"].get_group()
    box = [_rng_state()]
    dist.broadcast_object_list(box, group=group, group_src=0)
    _set_rng_state(box[0])


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _qualified_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


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
