"""A batch sampler whose position is two integers, so training resumes on the exact next batch.

Each epoch draws one permutation of the dataset from ``seed + epoch`` and cuts it into *global* batches of
``batch_size · world_size`` indices; process ``rank`` takes slice ``rank`` of each. A single process with
``batch_size · world_size`` therefore sees the same global batches as ``world_size`` processes together.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices for one process.

    Args:
        dataset_size: number of examples.
        batch_size: examples per batch on this process.
        shuffle: draw a fresh permutation per epoch (else dataset order).
        seed: permutation seed (epoch ``e`` uses ``seed + e``).
        rank: this process and the process count.
        world_size: this process and the process count.

    Raises:
        ValueError: bad sizes, or a dataset smaller than one global batch (the incomplete last global
            batch is dropped so every process steps in lockstep).
    """

    def __init__(self, dataset_size: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        for name, value in (("dataset_size", dataset_size), ("batch_size", batch_size), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if dataset_size < batch_size * world_size:
            raise ValueError(
                f"dataset of {dataset_size} examples is smaller than one global batch "
                f"(batch_size {batch_size} x world_size {world_size})"
            )
        self.dataset_size, self.batch_size, self.shuffle, self.seed = dataset_size, batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_size // (self.batch_size * self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next (as ``DistributedSampler.set_epoch``).

        Args:
            epoch: the epoch number (it seeds the shuffle).
        """
        self.epoch = epoch

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        """This process's batches of ``epoch``, from batch number ``start`` on.

        Args:
            epoch: the epoch number (it seeds the shuffle).
            start: the first batch (to resume inside an epoch).

        Yields:
            Lists of ``batch_size`` dataset indices.
        """
        if self.shuffle:
            order = torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.dataset_size)
        global_size = self.batch_size * self.world_size
        for b in range(start, self.batches_per_epoch):
            lo = b * global_size + self.rank * self.batch_size
            yield order[lo: lo + self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return self.epoch_batches(self.epoch)

    def __len__(self) -> int:
        return self.batches_per_epoch
