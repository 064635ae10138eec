"""Hybrid sharding (HSDP; ZeRO++'s hpZ, torchtitan's ``dp_replicate x dp_shard``): ZeRO over *shard groups*
of ``dp_shard`` consecutive replicas, the model state replicated across the groups.

The replica group (the ranks holding the same part of the model: data x context parallel) is cut into
blocks of ``S = dp_shard`` consecutive ranks -- a launcher numbers a host's ranks consecutively, so a
block of a node's size stays on its node -- and the ranks at the same place in each block form a
*replicate group* of ``R = replicas / S``. ZeRO runs inside a shard group as it runs over the whole
replica group without HSDP: parameters gathered, gradients reduce-scattered, optimizer state split in
``S``. Only the reduced shard crosses the groups: one all-reduce of ``1/S`` of the gradients over
``R`` ranks, after the reduce-scatter. So a step's gathers never leave the group (ZeRO-3's
``2 x`` the parameters per step, on the fast links), and what crosses the slow link is
``2 (R-1)/R x P/S`` per rank -- against ZeRO-3's ``3 (N-1)/N x P`` over all ``N`` ranks.

Memory is ZeRO's over ``S`` ranks rather than ``N``: the price of the locality.
"""

from __future__ import annotations

from distlab.errors import ConfigError


def shard_ways(strategy, replicas: int) -> int:
    """The ranks one ZeRO shard group spans among ``replicas`` (every replica without ``dp_shard``);
    a ``dp_shard`` that does not divide them is refused, naming the sizes that do."""
    s = strategy.dp_shard or replicas
    if replicas % s:
        fits = ", ".join(str(d) for d in range(1, replicas + 1) if replicas % d == 0)
        raise ConfigError(f"`dp_shard` {s} does not divide the {replicas} replicas (the data-parallel x "
                          f"context-parallel ranks ZeRO shards over): hybrid sharding cuts them into equal shard "
                          f"groups; use a `dp_shard` of {fits}")
    return s


def check_shard_groups(strategy, world_size: int | None = None) -> None:
    """``dp_shard`` names a ZeRO shard group's size: it needs the tuned ZeRO, a positive size and (on
    ``world_size`` ranks) one that divides the replicas."""
    if not strategy.dp_shard:
        return
    if strategy.dp_shard < 0:
        raise ConfigError(f"`dp_shard` must be positive (or 0: shard over every replica), not {strategy.dp_shard}")
    if not strategy.zero:
        raise ConfigError(f"`dp_shard` {strategy.dp_shard} is the size of a ZeRO shard group (hybrid sharding): "
                          f"give a stage too (`zero` 1-3), or drop `dp_shard`")
    if strategy.zero_impl != "tuned":
        raise ConfigError(f"`dp_shard` with `zero_impl` {strategy.zero_impl}: the plain ZeRO is the partition alone "
                          f"over one group; drop `zero_impl` (the tuned ZeRO shards hierarchically)")
    if world_size is not None:
        shard_ways(strategy, strategy.dp_size(world_size) * strategy.replica_ways)


def shard_groups(replica_groups: list[list[int]], s: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups) of ``replica_groups``: each cut into blocks of ``s`` consecutive
    ranks; a replicate group takes the ranks at the same place in each block of one replica group."""
    shards, replicates = [], []
    for group in replica_groups:
        blocks = [group[i:i + s] for i in range(0, len(group), s)]
        shards += blocks
        replicates += [[block[j] for block in blocks] for j in range(s)]
    return shards, replicates
