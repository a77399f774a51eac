"""Training utilities: collators, losses, schedules, the Trainer, multi-process helpers and built-in data.

- ``MLMCollator``, ``CausalLMCollator``, ``Seq2SeqCollator``: examples -> the batch dict a model takes.
- ``label_smoothed_cross_entropy``, ``TokenLoss``: the paper's label smoothing; per-token loss sums; ``TaskLoss``: the
  loss of a task head (by problem type), the Trainer's default for such models.
- ``NoamLR``, ``noam_rate``, ``paper_adam``, ``WarmupCosineLR``: optimiser and schedules.
- ``Trainer``, ``TrainerConfig``: accumulation, clipping, evaluation, progress bar, checkpoints, exact resume,
  DDP, FSDP2, tensor parallelism and both on a 2-D mesh (``training.parallel``); sharded checkpoints that
  load at any world size (``training.checkpoint``), checked and restored by ``training.resume``.
- ``default_loss``: the Trainer's loss for a model; ``consolidated_state_dict``: a sharded model's whole weights.
- ``init_distributed``: join a ``torchrun`` process group.
- ``ChatSFTDataset``, ``ChatSFTCollator``: chat SFT, the loss on the assistant's tokens, packed
  (``training.chat_sft``); ``PreferenceCollator``, ``PreferenceLoss``: DPO and SimPO (``training.preference``);
  ``training.perplexity.perplexity``: llama.cpp's method.
- ``load_corpus``, ``stdlib_docstrings``, ``split_corpus``: text with no download; ``SyntheticTask``: copy,
  reverse and addition.
"""

from .chat_sft import ChatSFTCollator, ChatSFTDataset
from .collators import CausalLMCollator, MLMCollator, Seq2SeqCollator, pack_documents, packed_examples, pad_rows
from .data import load_corpus, split_corpus, stdlib_docstrings
from .distributed import DistributedContext, cleanup, init_distributed, is_main_process
from .interrupt import TrainingInterrupted
from .losses import (
    LabelSmoothedCrossEntropy,
    MaskedTokenLoss,
    TaskLoss,
    TokenLoss,
    default_loss,
    label_smoothed_cross_entropy,
)
from .parallel import PARALLEL_MODES, apply_parallelism, clip_grad_norm, consolidated_state_dict
from .preference import PreferenceCollator, PreferenceLoss
from .sampler import ResumableBatchSampler
from .schedules import NoamLR, WarmupCosineLR, decay_groups, noam_rate, paper_adam, warmup_cosine_rate
from .synthetic import TASKS, SyntheticTask, held_out
from .trainer import Trainer, list_checkpoints
from .trainer_config import TrainerConfig

__all__ = [
    "PARALLEL_MODES",
    "TASKS",
    "CausalLMCollator",
    "ChatSFTCollator",
    "ChatSFTDataset",
    "DistributedContext",
    "LabelSmoothedCrossEntropy",
    "MLMCollator",
    "MaskedTokenLoss",
    "NoamLR",
    "PreferenceCollator",
    "PreferenceLoss",
    "ResumableBatchSampler",
    "Seq2SeqCollator",
    "SyntheticTask",
    "TaskLoss",
    "TokenLoss",
    "Trainer",
    "TrainerConfig",
    "TrainingInterrupted",
    "WarmupCosineLR",
    "apply_parallelism",
    "cleanup",
    "clip_grad_norm",
    "consolidated_state_dict",
    "decay_groups",
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
