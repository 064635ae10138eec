"""How a sequential global minibatch is split across ranks.

distlab uses the order of torch's :class:`~torch.utils.data.distributed.DistributedSampler`
(the training loader draws the very same indices as one tensor, not a list of every index:
:class:`distlab.data.loader.TrainLoader`). With the
same ``seed`` and ``epoch`` every rank draws the same permutation ``perm`` of the ``N`` indices
(``drop_last=True`` first cuts it to ``W * floor(N / W)``; ``drop_last=False`` pads it by repeating
its head up to ``W * ceil(N / W)``). Rank ``r`` then takes the strided slice ``perm[r::W]`` and a
:class:`~torch.utils.data.BatchSampler` cuts that into local batches of ``B``.

Local batch ``b`` of rank ``r`` is therefore ``perm[r + W*(b*B + j)]`` for ``j < B``, and the union
over all ranks of their ``b``-th local batch is ``perm[b*G : (b+1)*G]`` with ``G = W * B``: exactly
the ``b``-th minibatch a single process would see with batch size ``G`` on the same permutation
(sample ids interleave: with ``W = 2``, rank 0 holds positions 0, 2, 4, ... of it). This is why
data-parallel training on ``W`` ranks with local batch ``B`` equals single-process training with
batch ``G``. ``distlab demo sampler`` prints it for a dataset whose item ``i`` is ``10*i``.
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DistributedSampler


class _Length:
    """A stand-in dataset of a given length (the sampler only calls ``len``)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def distributed_sampler(n: int, *, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                        drop_last: bool = False) -> DistributedSampler:
    """torch's DistributedSampler over ``n`` indices (no dataset object needed)."""
    return DistributedSampler(_Length(n), num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)


def rank_batches(n: int, *, num_replicas: int, rank: int, batch_size: int, shuffle: bool = True,
                 seed: int = 0, epoch: int = 0, drop_last: bool = False,
                 batch_drop_last: bool = False) -> list[list[int]]:
    """The local batches (lists of indices) that rank ``rank`` sees in ``epoch``."""
    sampler = distributed_sampler(n, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last)
    sampler.set_epoch(epoch)
    return [list(b) for b in BatchSampler(sampler, batch_size, drop_last=batch_drop_last)]


def sequential_batches(n: int, *, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                       drop_last: bool = True) -> list[list[int]]:
    """The minibatches one process sees with the same permutation (the reference order)."""
    return rank_batches(n, num_replicas=1, rank=0, batch_size=batch_size, shuffle=shuffle, seed=seed,
                        epoch=epoch, batch_drop_last=drop_last)


def eval_shard(n: int, *, num_replicas: int, rank: int) -> torch.Tensor:
    """Indices of an evaluation shard: ``rank::num_replicas`` with no padding and no drop.

    Shards are disjoint and cover ``0..n-1`` exactly once, so summing per-rank loss sums,
    correct counts and sample counts gives the exact global metrics for any ``n``.
    """
    return torch.arange(rank, n, num_replicas)
