"""In-memory loaders: index a tensor dataset with sampler indices, a whole batch at a time.

A batch is one fancy-index of a tensor (the data set in memory, or a memory-mapped token file)
rather than ``B`` calls to ``__getitem__``; order and sharding are torch's sampler's.
"""

from __future__ import annotations

from typing import Iterator

import torch
from distlab.data.dataset import ImageDataset
from distlab.data.sampler import eval_shard


def _mix(*xs: int) -> int:
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class TrainLoader:
    """This rank's local batches of each global batch; every batch has exactly ``local_batch`` samples.

    Incomplete global batches at the end of an epoch are dropped, so every optimizer step sees
    ``global_batch = world_size * local_batch`` samples and equals the single-process step.

    The order is torch's :class:`~torch.utils.data.distributed.DistributedSampler`'s (``drop_last``),
    index for index (:mod:`distlab.data.sampler`), drawn as one tensor: the sampler makes a Python list of
    every index each epoch -- ~36 bytes a sample, 150 MB for a corpus of four million windows.
    """

    def __init__(self, dataset: ImageDataset, *, rank: int, world_size: int, local_batch: int,
                 shuffle: bool = True, seed: int = 0, augment: bool | None = None):
        self.dataset = dataset
        self.rank, self.world_size = rank, world_size
        self.local_batch = local_batch
        self.shuffle = shuffle
        self.seed = seed
        self.augment = dataset.augment if augment is None else augment
        self.per_rank = len(dataset) // world_size  # the sampler's num_samples with drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_rank // self.local_batch

    def order(self) -> torch.Tensor:
        """This rank's samples of the epoch in order: the sampler's permutation of every index (seeded by
        ``seed + epoch``), cut to a multiple of the world, every ``world_size``-th from ``rank``."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            perm = torch.randperm(n, generator=g)
        else:
            perm = torch.arange(n)
        return perm[self.rank:self.per_rank * self.world_size:self.world_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from batch ``start`` on, exactly as a full pass would yield them
        (a resumed run skips what it already trained on without loading it)."""
        order, b = self.order(), self.local_batch
        for step in range(start, len(self)):
            gen = None
            if self.augment:
                gen = torch.Generator().manual_seed(_mix(self.seed, self.epoch, step, self.rank))
            yield self.dataset.batch(order[step * b:(step + 1) * b], augment=self.augment, generator=gen)


class EvalLoader:
    """This rank's disjoint shard of an evaluation set, in batches (the last may be short or empty)."""

    def __init__(self, dataset: ImageDataset, *, rank: int, world_size: int, batch_size: int = 1000):
        self.dataset = dataset
        self.indices = eval_shard(len(dataset), num_replicas=world_size, rank=rank)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return (len(self.indices) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.indices), self.batch_size):
            yield self.dataset.batch(self.indices[start:start + self.batch_size], augment=False)
