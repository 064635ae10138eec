"""The process mesh for data x tensor parallel, tensor-parallel-major. Always built: tp=1 is a mesh.

With ``tp`` ranks per tensor-parallel group on a world of ``tp * dp``: TP groups are blocks of
consecutive ranks (they exchange activations every layer, so they should share a host), DP
groups take one rank from each block (they exchange gradients once per step). With tp=2, dp=4 on
8 ranks: TP groups {0,1},{2,3},{4,5},{6,7}; DP groups {0,2,4,6},{1,3,5,7}; rank ``r`` is
``(dp_rank, tp_rank) = (r // tp, r % tp)``. Ranks of one TP group see the same batch; the DP
groups' members see disjoint shards.

With tp=1 no group is created: the data-parallel group is the whole world (``dp_group`` None,
which every ``torch.distributed`` call reads as the default group) and there is no
tensor-parallel group to talk to (``tp_group`` None, never used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from distlab.errors import ConfigError


def layout(world_size: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(tp_groups, dp_groups)`` as lists of global ranks (no communication)."""
    if tp < 1 or world_size % tp:
        raise ConfigError(f"`tp` {tp} does not divide the world size {world_size}: use a `tp` that divides it "
                          f"(e.g. {', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)})")
    dp = world_size // tp
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(dp)]
    dp_groups = [list(range(j, world_size, tp)) for j in range(tp)]
    return tp_groups, dp_groups


@dataclass
class Mesh:
    rank: int
    world_size: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    tp_ranks: list[int]
    dp_ranks: list[int]

    def describe(self) -> str:
        """``dp 2 x tp 2: TP groups [0, 1] [2, 3]; DP groups [0, 2] [1, 3]`` (or one word for tp=1)."""
        if self.world_size == 1:
            return "single process"
        if self.tp == 1:
            return f"dp {self.dp}: ranks 0-{self.world_size - 1} in one data-parallel group"
        tp_groups, dp_groups = layout(self.world_size, self.tp)
        return (f"dp {self.dp} x tp {self.tp}: TP groups {' '.join(map(str, tp_groups))}; "
                f"DP groups {' '.join(map(str, dp_groups))}")


def build_mesh(tp: int = 1, dp: int | None = None) -> Mesh:
    """The mesh of this process (collective when tp > 1: every rank calls it, in the same order)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp_groups, dp_groups = layout(world, tp)
    if dp is not None and tp * dp != world:
        raise ConfigError(f"`tp` {tp} x dp {dp} = {tp * dp} processes, but the world has {world}: "
                          f"make tp x dp equal the number of processes")
    mine_tp = next(g for g in tp_groups if rank in g)
    mine_dp = next(g for g in dp_groups if rank in g)
    tp_group = dp_group = None
    if world > 1 and tp > 1:
        for g in tp_groups:  # new_group is collective over the whole world: create every group everywhere
            pg = dist.new_group(g)
            if g is mine_tp:
                tp_group = pg
        for g in dp_groups:
            pg = dist.new_group(g)
            if g is mine_dp:
                dp_group = pg
    return Mesh(rank, world, tp, world // tp, mine_tp.index(rank), mine_dp.index(rank), tp_group, dp_group,
                mine_tp, mine_dp)
