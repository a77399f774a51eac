"""``Trainer``: the training loop — gradient accumulation, clipping, evaluation, a progress bar,
checkpoints and exact resume, on one process or many (DDP, FSDP2, tensor parallel, FSDP + TP).

Every optimiser step consumes ``grad_accum_steps`` micro-batches per data-parallel replica. The loss of a
step is the sum of per-token losses divided by the number of target tokens in the whole step (all
micro-batches, all replicas), so accumulation and multi-process runs give the same update as one big batch.

The Trainer shards the model first and builds the optimiser afterwards, from a factory, over the
trainable parameters only (``requires_grad=True``), so the optimiser always holds what the processes
really own. Checkpoints (files: ``training.checkpoint``) hold the trainable parameters, the optimiser,
scheduler, data position, history and random states; they load at another world size or layout and
are checked before anything is restored (``training.resume``). The configuration is ``TrainerConfig``
(``training.trainer_config``).
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .checkpoint import CHECKPOINT_PREFIX, list_checkpoints
from .collators import input_tokens
from .distributed import barrier, default_device, get_rank, get_world_size, is_distributed, rng_state, unwrap_model
from .interrupt import TrainingInterrupted, step_boundary_interrupt
from .losses import TokenLoss, default_loss
from .optimizer_setup import (
    OptimizerFactory,
    SchedulerFactory,
    built_optimizer,
    built_scheduler,
    check_optimizer,
    check_optimizer_arguments,
)
from .parallel import (
    apply_parallelism,
    clip_grad_norm,
    consolidated_state_dict,
    gradient_sync,
    parallel_layout,
    replica_sum,
    share_rng_in_tensor_parallel_group,
    unsharded_class,
)
from .resume import restore_checkpoint, run_shape, trainer_state
from .sampler import ResumableBatchSampler
from .trainer_config import TrainerConfig

__all__ = ["CHECKPOINT_PREFIX", "Trainer", "TrainerConfig", "consolidated_state_dict", "default_loss",
           "list_checkpoints"]

LossFunction = Callable[[nn.Module, Mapping[str, Any]], Tensor]


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
        eval_data: the evaluation set (indexable, like ``train_data``).
        eval_collate_fn: its collator (default ``collate_fn``).
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
        check_optimizer_arguments(optimizer, scheduler)
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
            check_optimizer(optimizer, model)
        self.device = torch.device(config.device) if config.device else default_device()
        self.model = model.to(self.device)
        self.wrapped, self.layout = apply_parallelism(
            self.model, config.parallel, self.device, tp_size=config.tp_size,
            mixed_precision=config.mixed_precision, activation_checkpointing=config.activation_checkpointing,
        )
        self.sampler.rank = self.layout.dp_rank
        if self.layout.tp_size > 1:
            share_rng_in_tensor_parallel_group(self.layout)
        self.optimizer = built_optimizer(optimizer, self.model)
        self.scheduler = built_scheduler(scheduler, self.optimizer)
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

        Args:
            until: the optimiser step to stop after (``0 <= until <= max_steps``); a later call goes on from there,
                so ``train(until=k)`` then ``train()`` is the same run as ``train()``. None: ``max_steps``.

        Returns:
            The history: one ``{"step", "loss", "lr", "tokens"}`` per optimiser step since step 1
            (a resumed trainer carries the history of its checkpoint).

        Raises:
            ValueError: ``until`` beyond ``max_steps``.
            TrainingInterrupted: Ctrl-C (SIGINT, one process), raised after the optimiser step it came in
                (``training.interrupt``): ``self.step`` and the state are those of a complete step, so
                ``save_checkpoint()`` then resumes exactly; a second Ctrl-C interrupts at once.
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
        with step_boundary_interrupt(enabled=self.world_size == 1) as interrupted:
            try:
                while self.step < until:
                    if interrupted():
                        raise TrainingInterrupted(self.step)
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
        targets = replica_sum(torch.tensor(float(local_targets), device=self.device), self.layout).item()
        # DDP and FSDP average gradients over the data-parallel replicas; multiplying by their number turns that
        # into a sum (tensor-parallel peers do not average: they hold different slices of one gradient).
        scale = self.layout.dp_size / max(targets, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with gradient_sync(self.wrapped, self.model, self.layout, last):
                loss = self.loss_fn(self.wrapped, batch)
                (loss * scale).backward()
            loss_sum += loss.detach().float()
        tokens = float(sum(input_tokens(b) for b in micro_batches))
        stats = replica_sum(torch.stack([loss_sum, torch.tensor(tokens, device=self.device)]), self.layout)
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
        loss_sum, count = replica_sum(totals, self.layout).tolist()
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
            plain = unsharded_class(model)(model.config)
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

        Args:
            directory: the checkpoint directory (created if needed); None: ``config.checkpoint_dir``. Every process
                must pass the same one (it is a collective).

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
        ckpt.save_torch(rng_state(), staging / ckpt.rng_name(self.rank))
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
        return trainer_state(self.model, self.optimizer, self.scheduler, run=self._run_shape(),
                             position=(self.step, self.epoch, self.batch_in_epoch), history=self.history,
                             eval_history=self.eval_history, config=self.config)

    def _run_shape(self) -> dict[str, Any]:
        return run_shape(self.config, self.layout, world_size=self.world_size, dataset_size=len(self.train_data))

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
            ValueError: a damaged, missing or unlisted file or a bad field (each named), or a checkpoint that does
                not fit this run (what changed is said): another dataset length, global batch, accumulation, data
                order, world size (unless allowed), optimiser, scheduler (class or settings), or model.
            OSError: a file could not be read (named). On any error the trainer and model are as they were.
        """
        if not isinstance(allow_world_size_change, bool):
            raise ValueError(f"allow_world_size_change must be True or False, got {allow_world_size_change!r}")
        path = self._resolve_checkpoint(path)
        state = restore_checkpoint(path, self.model, self.optimizer, self.scheduler, self.layout, self._run_shape(),
                                   rank=self.rank, allow_world_size_change=allow_world_size_change)
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.history, self.eval_history = list(state["history"]), list(state["eval_history"])
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
