import itertools

import pytest
import torch

from distlab.data.dataset import ImageDataset
from distlab.data.loader import EvalLoader, TrainLoader
from distlab.data.sampler import eval_shard, rank_batches, sequential_batches


def _flat(batches):
    return [i for b in batches for i in b]


@pytest.mark.parametrize("n,world", [(24, 2), (10, 3), (7, 4), (5, 5), (3, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover_or_drop_exactly(n, world, shuffle):
    # drop_last=True: W * floor(n/W) distinct indices, the rest dropped
    kept = [_flat(rank_batches(n, num_replicas=world, rank=r, batch_size=2, shuffle=shuffle, drop_last=True))
            for r in range(world)]
    everything = list(itertools.chain(*kept))
    assert len(everything) == len(set(everything)) == world * (n // world)
    # drop_last=False: every index at least once; exactly (-n) % W repeats (torch pads from the head)
    padded = [_flat(rank_batches(n, num_replicas=world, rank=r, batch_size=2, shuffle=shuffle))
              for r in range(world)]
    everything = list(itertools.chain(*padded))
    assert set(everything) == set(range(n)) and len(everything) == n + (-n) % world


@pytest.mark.parametrize("n,world,local", [(24, 2, 4), (50, 3, 4), (37, 4, 3), (10, 1, 3)])
def test_local_batches_make_up_the_sequential_global_batch_under_shuffle(n, world, local):
    for epoch in (0, 3):
        per_rank = [rank_batches(n, num_replicas=world, rank=r, batch_size=local, shuffle=True, seed=7,
                                 epoch=epoch, drop_last=True, batch_drop_last=True) for r in range(world)]
        seq = sequential_batches(n, batch_size=world * local, shuffle=True, seed=7, epoch=epoch)
        steps = min(len(b) for b in per_rank)
        assert steps == len(seq) == n // (world * local)
        for b in range(steps):
            union = sorted(i for r in range(world) for i in per_rank[r][b])
            assert union == sorted(seq[b])
            # and the interleaving is the documented one: rank r holds positions r, r+W, ...
            for r in range(world):
                assert per_rank[r][b] == seq[b][r::world]


def test_epochs_reshuffle_and_batch_sampler_drop_last():
    a = sequential_batches(20, batch_size=20, seed=1, epoch=0)[0]
    b = sequential_batches(20, batch_size=20, seed=1, epoch=1)[0]
    assert sorted(a) == sorted(b) and a != b
    kept = rank_batches(10, num_replicas=2, rank=0, batch_size=2, shuffle=False, batch_drop_last=True)
    short = rank_batches(10, num_replicas=2, rank=0, batch_size=2, shuffle=False, batch_drop_last=False)
    assert kept == [[0, 2], [4, 6]] and short == [[0, 2], [4, 6], [8]]


@pytest.mark.parametrize("n,world", [(10, 3), (3, 4), (1000, 7)])
def test_eval_shards_cover_exactly_once(n, world):
    shards = [eval_shard(n, num_replicas=world, rank=r).tolist() for r in range(world)]
    assert sorted(itertools.chain(*shards)) == list(range(n))


def _toy(n=30):
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1)
    return ImageDataset("toy", "train", images, torch.arange(n) % 3, 3, (0.0,), (1.0,))


def test_train_loaders_of_all_ranks_together_give_the_single_process_batches():
    ds, world, local = _toy(), 3, 2
    single = TrainLoader(ds, rank=0, world_size=1, local_batch=world * local, seed=5)
    ranks = [TrainLoader(ds, rank=r, world_size=world, local_batch=local, seed=5) for r in range(world)]
    for loader in [single, *ranks]:
        loader.set_epoch(2)
    assert len(single) == len(ranks[0]) == 30 // 6
    for (x1, y1), *parts in zip(single, *ranks):
        assert sorted(torch.cat([x for x, _ in parts]).flatten().tolist()) == sorted(x1.flatten().tolist())


def test_eval_loader_shards_without_padding():
    ds = _toy(10)
    seen = [x.flatten().tolist() for r in range(4) for x, _ in EvalLoader(ds, rank=r, world_size=4, batch_size=2)]
    assert sorted(itertools.chain(*seen)) == list(map(float, range(10)))


class _Windows:
    """A data set of ``n`` samples whose batch is its indices (what a corpus of millions of windows asks
    of a loader: ``len`` and ``batch``)."""

    augment = False

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def batch(self, idx, **_):
        return idx, idx


@pytest.mark.parametrize("n,world,local,shuffle", [(103, 3, 4, True), (96, 4, 3, True), (50, 2, 7, False), (9, 1, 2, True)])
def test_a_loaders_batches_are_torchs_distributed_samplers_for_every_epoch_and_start(n, world, local, shuffle):
    for rank in range(world):
        loader = TrainLoader(_Windows(n), rank=rank, world_size=world, local_batch=local, shuffle=shuffle, seed=11)
        for epoch in (0, 3):
            loader.set_epoch(epoch)
            expected = rank_batches(n, num_replicas=world, rank=rank, batch_size=local, shuffle=shuffle, seed=11,
                                    epoch=epoch, drop_last=True, batch_drop_last=True)
            assert len(loader) == len(expected)
            assert [x.tolist() for x, _ in loader] == expected
            assert [x.tolist() for x, _ in loader.iter_from(2)] == expected[2:]


def test_a_loader_over_millions_of_samples_holds_no_list_of_every_index():
    import tracemalloc
    loader = TrainLoader(_Windows(2_000_000), rank=1, world_size=2, local_batch=8, seed=0)
    tracemalloc.start()
    try:
        next(loader.iter_from(5))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MB of Python objects to draw one batch"  # a list: ~70 MB
