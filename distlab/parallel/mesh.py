"""The process mesh: data x tensor x pipeline parallel, tensor innermost, pipeline outermost.

A world of ``pp * dp * tp`` ranks. Rank ``r`` is ``(pp_rank, dp_rank, tp_rank)`` with
``r = (pp_rank * dp + dp_rank) * tp + tp_rank``:

* **TP groups** are blocks of ``tp`` consecutive ranks: they exchange activations in every layer,
  so they should share a host (launchers number a host's ranks consecutively).
* **DP groups** take the ranks with the same pipeline stage and tensor-parallel rank: they
  exchange gradients once per step; their members see disjoint shards of the batch.
* **PP groups** (pipelines) take the ranks with the same data- and tensor-parallel rank, one per
  stage, in stage order: they pass activations and gradients point-to-point, neighbour to
  neighbour, a few times per step.

With tp=2, pp=2 on 8 ranks (dp 2): TP groups {0,1},{2,3},{4,5},{6,7}; DP groups {0,2},{1,3},
{4,6},{5,7}; pipelines {0,4},{1,5},{2,6},{3,7} -- ranks 0-3 hold the first stage, 4-7 the
second. Every rank of a TP group and of a pipeline reads the same batch.

With tp=1 and pp=1 no group is created: the data-parallel group is the whole world (``dp_group``
None, which every ``torch.distributed`` call reads as the default group). A group the mesh does
not need (``tp_group`` with tp=1, ``pp_group`` with pp=1) is None and never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from distlab.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """The groups of a mesh as lists of global ranks (no communication)."""

    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    pp_groups: list[list[int]]


def layout(world_size: int, tp: int, pp: int = 1) -> Layout:
    """Which global ranks form each group of a ``tp`` x ``pp`` mesh on ``world_size`` ranks."""
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        what = f"`tp` {tp}" if pp == 1 else f"`tp` {tp} x `pp` {pp} = {tp * pp}"
        raise ConfigError(f"{what} does not divide the world size {world_size}: use sizes whose product divides "
                          f"it ({divisors})")
    dp = world_size // (tp * pp)

    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    return Layout(tp_groups=[[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
                  dp_groups=[[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
                  pp_groups=[[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)])


def _groups(groups: list[list[int]]) -> str:
    return " ".join(str(g) for g in groups)


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
    pp: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    pp_ranks: list[int] | None = None

    @property
    def last_stage(self) -> bool:
        """Whether this rank holds the model's last layers (where the loss is computed)."""
        return self.pp_rank == self.pp - 1

    @property
    def splits_model(self) -> bool:
        """Whether ranks hold different parts of the model (tensor-parallel shards, pipeline stages)."""
        return self.tp > 1 or self.pp > 1

    @property
    def reports(self) -> bool:
        """Whether this rank's scores count once in a sum over the world: one rank per data shard
        (the last pipeline stage, tensor-parallel rank 0)."""
        return self.last_stage and self.tp_rank == 0

    def describe(self) -> str:
        """``dp 2 x tp 2: TP groups [0, 1] [2, 3]; DP groups [0, 2] [1, 3]`` (or one word for dp only)."""
        if self.world_size == 1:
            return "single process"
        if self.tp == 1 and self.pp == 1:
            return f"dp {self.dp}: ranks 0-{self.world_size - 1} in one data-parallel group"
        groups = layout(self.world_size, self.tp, self.pp)
        sizes = " x ".join(f"{name} {n}" for name, n in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
                           if n > 1 or name == "dp")
        parts = ([f"TP groups {_groups(groups.tp_groups)}"] if self.tp > 1 else []) + \
                [f"DP groups {_groups(groups.dp_groups)}"] + \
                ([f"pipelines (stage 0 first) {_groups(groups.pp_groups)}"] if self.pp > 1 else [])
        return f"{sizes}: {'; '.join(parts)}"


def build_mesh(tp: int = 1, dp: int | None = None, pp: int = 1) -> Mesh:
    """The mesh of this process (collective when tp or pp > 1: every rank calls it, in the same order)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = layout(world, tp, pp)
    if dp is not None and tp * dp * pp != world:
        raise ConfigError(f"`tp` {tp} x dp {dp}{f' x `pp` {pp}' if pp > 1 else ''} = {tp * dp * pp} processes, but "
                          f"the world has {world}: make the product equal the number of processes")

    def mine(kind: list[list[int]]) -> list[int]:
        return next(g for g in kind if rank in g)

    made: dict[str, dist.ProcessGroup | None] = {"tp": None, "dp": None, "pp": None}
    if world > 1 and (tp > 1 or pp > 1):
        # new_group is collective over the whole world: every rank creates every group, in one order
        for kind, needed in (("tp", tp > 1), ("dp", True), ("pp", pp > 1)):
            for g in getattr(groups, f"{kind}_groups") if needed else ():
                pg = dist.new_group(g)
                if rank in g:
                    made[kind] = pg
    tp_ranks, dp_ranks, pp_ranks = mine(groups.tp_groups), mine(groups.dp_groups), mine(groups.pp_groups)
    return Mesh(rank, world, tp, world // (tp * pp), tp_ranks.index(rank), dp_ranks.index(rank), made["tp"],
                made["dp"], tp_ranks, dp_ranks, pp, pp_ranks.index(rank), made["pp"], pp_ranks)
