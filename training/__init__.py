"""Training utilities: collators, losses, schedules, the Trainer, multi-process helpers and built-in data.

- ``MLMCollator``, ``CausalLMCollator``, ``Seq2SeqCollator``: examples -> the batch dict a model takes.
- ``label_smoothed_cross_entropy``, ``TokenLoss``: the paper's label smoothing; per-token loss sums.
- ``NoamLR``, ``noam_rate``, ``paper_adam``, ``WarmupCosineLR``: optimiser and schedules.
- ``Trainer``, ``TrainerConfig``: accumulation, clipping, evaluation, progress bar, checkpoints, exact resume, DDP.
- ``init_distributed``: join a ``torchrun`` process group.
- ``load_corpus``, ``stdlib_docstrings``, ``split_corpus``: text with no download; ``SyntheticTask``: copy,
  reverse and addition.
"""

from .collators import CausalLMCollator, MLMCollator, Seq2SeqCollator, pack_documents, packed_examples, pad_rows
from .data import load_corpus, split_corpus, stdlib_docstrings
from .distributed import DistributedContext, cleanup, init_distributed, is_main_process
from .losses import LabelSmoothedCrossEntropy, MaskedTokenLoss, TokenLoss, label_smoothed_cross_entropy
from .sampler import ResumableBatchSampler
from .schedules import NoamLR, WarmupCosineLR, noam_rate, paper_adam, warmup_cosine_rate
from .synthetic import TASKS, SyntheticTask, held_out
from .trainer import Trainer, TrainerConfig, default_loss, list_checkpoints

__all__ = [
    "TASKS",
    "CausalLMCollator",
    "DistributedContext",
    "LabelSmoothedCrossEntropy",
    "MLMCollator",
    "MaskedTokenLoss",
    "NoamLR",
    "ResumableBatchSampler",
    "Seq2SeqCollator",
    "SyntheticTask",
    "TokenLoss",
    "Trainer",
    "TrainerConfig",
    "WarmupCosineLR",
    "cleanup",
    "default_loss",
    "held_out",
    "init_distributed",
    "is_main_process",
    "label_smoothed_cross_entropy",
    "list_checkpoints",
    "load_corpus",
    "noam_rate",
    "pack_documents",
    "packed_examples",
    "pad_rows",
    "paper_adam",
    "split_corpus",
    "stdlib_docstrings",
    "warmup_cosine_rate",
]
