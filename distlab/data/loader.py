"""In-memory loaders: index a tensor dataset with sampler indices, a whole batch at a time.

The datasets here fit in memory (Fashion-MNIST is 47 MB as uint8), so a batch is one fancy-index
of a tensor rather than ``B`` calls to ``__getitem__``; order and sharding are torch's sampler's.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import BatchSampler

from distlab.data.dataset import ImageDataset
from distlab.data.sampler import distributed_sampler, eval_shard


def _mix(*xs: int) -> int:
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class TrainLoader:
    """This rank's local batches of each global batch; every batch has exactly ``local_batch`` samples.

    Incomplete global batches at the end of an epoch are dropped, so every optimizer step sees
    ``global_batch = world_size * local_batch`` samples and equals the single-process step.
    """

    def __init__(self, dataset: ImageDataset, *, rank: int, world_size: int, local_batch: int,
                 shuffle: bool = True, seed: int = 0, augment: bool | None = None):
        self.dataset = dataset
        self.rank = rank
        self.local_batch = local_batch
        self.seed = seed
        self.augment = dataset.augment if augment is None else augment
        self.sampler = distributed_sampler(len(dataset), num_replicas=world_size, rank=rank,
                                           shuffle=shuffle, seed=seed, drop_last=True)
        self.batches = BatchSampler(self.sampler, local_batch, drop_last=True)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from batch ``start`` on, exactly as a full pass would yield them
        (a resumed run skips what it already trained on without loading it)."""
        for step, idx in enumerate(self.batches):
            if step < start:
                continue
            gen = None
            if self.augment:
                gen = torch.Generator().manual_seed(_mix(self.seed, self.epoch, step, self.rank))
            yield self.dataset.batch(torch.as_tensor(idx), augment=self.augment, generator=gen)


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
