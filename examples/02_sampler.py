"""How a global minibatch is split across ranks -- and why the pieces add up to one process's batch.

    python examples/02_sampler.py

No processes needed: torch's DistributedSampler only needs a rank number and a world size, so
this script plays every rank of a 3-rank job itself. It prints each rank's local batches of a
13-item dataset (drop_last: 12 are used), shows that local batch b of all ranks together is exactly minibatch b of a single
process with the 3x larger batch, then shows what ``drop_last`` does when the dataset does not
divide evenly. Tutorial: docs/02-sampler.md.
"""

from distlab.data.sampler import eval_shard, rank_batches, sequential_batches

N, WORLD, LOCAL = 13, 3, 2  # 13 samples, 3 ranks, local batch 2 -> global batch 6


def main() -> None:
    print(f"dataset of {N} samples, {WORLD} ranks, local batch {LOCAL} (global batch {WORLD * LOCAL}), seed 0, epoch 0")
    per_rank = {r: rank_batches(N, num_replicas=WORLD, rank=r, batch_size=LOCAL, seed=0, epoch=0, drop_last=True)
                for r in range(WORLD)}
    for r, batches in per_rank.items():
        print(f"  rank {r}: local batches {batches}")
    reference = sequential_batches(N, batch_size=WORLD * LOCAL, seed=0, epoch=0)
    print(f"one process, batch {WORLD * LOCAL}: {reference}")
    for b, ref in enumerate(reference):
        union = sorted(i for r in range(WORLD) for i in per_rank[r][b])
        print(f"  minibatch {b}: ranks together {union} == one process {sorted(ref)}: {union == sorted(ref)}")
        assert union == sorted(ref)

    # A new epoch reshuffles -- identically on every rank, because they share seed and epoch.
    e1 = [rank_batches(N, num_replicas=WORLD, rank=r, batch_size=LOCAL, seed=0, epoch=1, drop_last=True)[0]
          for r in range(WORLD)]
    print(f"epoch 1, first local batch of each rank: {e1} (a different split, still disjoint)")
    assert len({i for b in e1 for i in b}) == WORLD * LOCAL

    # drop_last=False pads by repeating the first indices so every rank gets the same count:
    padded = [rank_batches(N, num_replicas=WORLD, rank=r, batch_size=LOCAL, seed=0, drop_last=False)
              for r in range(WORLD)]
    seen = [i for batches in padded for b in batches for i in b]
    print(f"drop_last=False: {len(seen)} indices for {N} samples -- {len(seen) - N} repeated "
          f"(training sees them twice; that is why evaluation uses disjoint shards instead):")
    for r in range(WORLD):
        print(f"  rank {r}: eval shard {eval_shard(N, num_replicas=WORLD, rank=r).tolist()}")


if __name__ == "__main__":
    main()
