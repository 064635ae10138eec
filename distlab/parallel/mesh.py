"""The process mesh: pipeline x data x (extra) x context x tensor parallel, tensor innermost, pipeline outermost.

A world of ``pp * dp * cp * tp`` ranks. Rank ``r`` is ``(pp_rank, dp_rank, cp_rank, tp_rank)`` with
``r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``:

* **TP groups** are blocks of ``tp`` consecutive ranks: they exchange activations in every layer,
  so they should share a host (launchers number a host's ranks consecutively).
* **DP groups** take the ranks with the same pipeline stage and tensor-parallel rank: they
  exchange gradients once per step; their members see disjoint shards of the batch.
* **CP groups** (context parallel) take the ranks with the same pipeline stage, data-parallel and
  tensor-parallel rank: they read the same batch and each keeps its share of every sequence; they
  pass keys and values (or all-to-all their heads) in every attention layer.
* **Replica groups** are the data- and context-parallel ranks together (the same stage and
  tensor-parallel rank): they hold the same part of the model, so gradients are averaged over them
  and ZeRO shards over them. Without context parallel they are the DP groups.
* **EP groups** (expert parallel) cut each DP group into blocks of ``ep`` consecutive data-parallel
  ranks: a mixture of experts' experts are sharded over them and its tokens travel between them
  by all-to-all. **Expert-data groups** take the replica ranks holding the same expert shard
  (the same ``dp_rank mod ep``): expert gradients are reduced over them.
* **PP groups** (pipelines) take the ranks with the same data- and tensor-parallel rank, one per
  stage, in stage order: they pass activations and gradients point-to-point, neighbour to
  neighbour, a few times per step.

With tp=2, pp=2 on 8 ranks (dp 2): TP groups {0,1},{2,3},{4,5},{6,7}; DP groups {0,2},{1,3},
{4,6},{5,7}; pipelines {0,4},{1,5},{2,6},{3,7} -- ranks 0-3 hold the first stage, 4-7 the
second. Every rank of a TP group and of a pipeline reads the same batch.

* **Extra dimensions** (:class:`Dim`: a registered component kind's own, ``dim = name``, sized
  ``+NAME=N``) sit between the data- and the context-parallel dimension, in the strategy's order:
  a group along one is the ranks that differ only there (``mesh.dims[NAME]``); one that
  ``replicates`` the model joins the replica groups.

With tp=1 and pp=1 no group is created: the data-parallel group is the whole world (``dp_group``
None, which every ``torch.distributed`` call reads as the default group). A group the mesh does
not need (``tp_group`` with tp=1, ``pp_group`` with pp=1) is None and never used.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch.distributed as dist

from distlab.errors import ConfigError
from distlab.parallel.zero.hsdp import shard_groups


@dataclass(frozen=True)
class Dim:
    """A mesh dimension beyond the built-in ones, owned by a registered component kind (its ``dim``):
    its ``size``, and whether the ranks along it hold the same part of the model (``replicates``:
    gradients are averaged and ZeRO shards over them, as over context parallel's)."""

    name: str
    size: int
    replicates: bool = False


@dataclass(frozen=True)
class Layout:
    """The groups of a mesh as lists of global ranks (no communication)."""

    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    pp_groups: list[list[int]]
    cp_groups: list[list[int]]
    replica_groups: list[list[int]]
    ep_groups: list[list[int]]
    expert_data_groups: list[list[int]]
    dim_groups: dict[str, list[list[int]]] = field(default_factory=dict)  # each extra dimension's groups
    shard_groups: list[list[int]] = field(default_factory=list)  # hybrid sharding: ZeRO's groups in a replica group
    replicate_groups: list[list[int]] = field(default_factory=list)  # ... and the ranks holding the same shard


def layout(world_size: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1, dims: tuple[Dim, ...] = (),
           dp_shard: int = 0) -> Layout:
    """Which global ranks form each group of a ``tp`` x ``cp`` x ``pp`` mesh on ``world_size`` ranks,
    with expert parallel over blocks of ``ep`` data-parallel ranks and the extra ``dims`` between the
    data- and the context-parallel dimension (in their order, the first outermost); ``dp_shard``: each
    replica group cut into shard groups of that many consecutive ranks (:mod:`~distlab.parallel.zero.hsdp`).

    A group along a dimension is the ranks that differ only there, in rank order; the groups of a kind
    are listed in the order of their first rank."""
    sizes = {"pp": pp, "dp": 1, **{d.name: d.size for d in dims}, "cp": cp, "tp": tp}
    model = tp * pp * cp * math.prod(d.size for d in dims)
    if min(sizes.values()) < 1 or world_size % model:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        named = [f"`{k}` {sizes[k]}" for k in ("tp", "cp", "pp", *(d.name for d in dims)) if sizes[k] != 1 or k == "tp"]
        what = named[0] if len(named) == 1 else f"{' x '.join(named)} = {model}"
        raise ConfigError(f"{what} does not divide the world size {world_size}: use sizes whose product divides "
                          f"it ({divisors})")
    dp = sizes["dp"] = world_size // model
    if ep < 1 or dp % ep:
        raise ConfigError(f"`ep` {ep} must divide the data-parallel size {dp} (expert parallel shards the experts "
                          f"over data-parallel ranks): choose an `ep` that divides {dp}")
    coords = list(itertools.product(*(range(n) for n in sizes.values())))  # rank r is coords[r]
    at = {name: i for i, name in enumerate(sizes)}

    def along(*varying: str, key=lambda c: ()) -> list[list[int]]:
        """The groups of ranks that differ only in ``varying`` (and agree on ``key``)."""
        fixed = [i for name, i in at.items() if name not in varying]
        out: dict[tuple, list[int]] = {}
        for r, c in enumerate(coords):
            out.setdefault((*(c[i] for i in fixed), *key(c)), []).append(r)
        return list(out.values())

    replicated = ("dp", "cp", *(d.name for d in dims if d.replicates))
    replicas = along(*replicated)
    shards, replicates = shard_groups(replicas, dp_shard) if dp_shard else ([], [])
    return Layout(tp_groups=along("tp"), dp_groups=along("dp"), pp_groups=along("pp"), cp_groups=along("cp"),
                  replica_groups=replicas,
                  ep_groups=along("dp", key=lambda c: (c[at["dp"]] // ep,)),
                  expert_data_groups=along(*replicated, key=lambda c: (c[at["dp"]] % ep,)),
                  dim_groups={d.name: along(d.name) for d in dims}, shard_groups=shards, replicate_groups=replicates)


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
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    cp_ranks: list[int] | None = None
    replica_group: dist.ProcessGroup | None = None  # data x context parallel: gradients averaged, ZeRO shards
    replica_ranks: list[int] | None = None
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None  # expert parallel: the ranks sharing out the experts
    ep_ranks: list[int] | None = None
    expert_data_group: dist.ProcessGroup | None = None  # the replicas of this rank's expert shard
    expert_data_ranks: list[int] | None = None
    dims: dict[str, "Axis"] = field(default_factory=dict)  # the extra dimensions, by name (registered kinds')
    shard_group: dist.ProcessGroup | None = None  # what ZeRO shards over: the replicas, or (HSDP) a block of them
    shard_ranks: list[int] | None = None
    replicate_group: dist.ProcessGroup | None = None  # HSDP: the ranks holding the same shard (None without)
    replicate_ranks: list[int] | None = None

    def __post_init__(self) -> None:
        if self.replica_ranks is None:  # no context parallel: the replicas are the data-parallel ranks
            self.replica_group, self.replica_ranks = self.dp_group, self.dp_ranks
        if self.shard_ranks is None:  # no hybrid sharding: ZeRO shards over every replica
            self.shard_group, self.shard_ranks = self.replica_group, self.replica_ranks

    @classmethod
    def of(cls, strategy) -> "Mesh":
        """This process's mesh for ``strategy``: every dimension its fields name (tp, pp, cp, ep), the rest
        data parallel (collective: every rank calls it, in the same order)."""
        return build_mesh(strategy.tp, pp=strategy.pp, cp=strategy.cp, ep=strategy.ep, dims=strategy.extra_dims(),
                          dp_shard=strategy.dp_shard)

    def size(self, dim: str) -> int:
        """The size of dimension ``dim`` (``tp``, ``dp``, ``pp``, ``cp``, ``ep`` or an extra one's name; 1
        for one the mesh does not have)."""
        return self.dims[dim].size if dim in self.dims else getattr(self, dim, 1)

    @property
    def last_stage(self) -> bool:
        """Whether this rank holds the model's last layers (where the loss is computed)."""
        return self.pp_rank == self.pp - 1

    @property
    def splits_model(self) -> bool:
        """Whether ranks hold different parts of the model (tensor-parallel shards, pipeline stages,
        expert shards)."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1 or any(not d.replicates for d in self.dims.values())

    @property
    def replicas(self) -> int:
        """Ranks holding the same part of the model (data x context parallel x the extra dimensions that
        replicate it)."""
        return self.dp * self.cp * math.prod(d.size for d in self.dims.values() if d.replicates)

    @property
    def reports(self) -> bool:
        """Whether this rank's scores count once in a sum over the world: one rank per data shard and
        share of its sequences (the last pipeline stage, tensor-parallel rank 0; every context-parallel
        rank, each for its own tokens)."""
        return self.last_stage and self.tp_rank == 0

    def describe(self) -> str:
        """``dp 2 x tp 2: TP groups [0, 1] [2, 3]; DP groups [0, 2] [1, 3]`` (or one word for dp only)."""
        if self.world_size == 1:
            return "single process"
        s = len(self.shard_ranks) if self.replicate_ranks else 0  # hybrid sharding's shard groups
        if self.world_size == self.dp and self.ep == 1 and not s:
            return f"dp {self.dp}: ranks 0-{self.world_size - 1} in one data-parallel group"
        dims = tuple(self.dims.values())
        groups = layout(self.world_size, self.tp, self.pp, self.cp, self.ep, dims, s)
        sizes = " x ".join(f"{name} {n}" for name, n in (("pp", self.pp), ("dp", self.dp),
                                                           *((d.name, d.size) for d in dims), ("cp", self.cp),
                                                           ("tp", self.tp)) if n > 1 or name == "dp")
        parts = ([f"TP groups {_groups(groups.tp_groups)}"] if self.tp > 1 else []) + \
                ([f"CP groups {_groups(groups.cp_groups)}"] if self.cp > 1 else []) + \
                [f"{d.name} groups {_groups(groups.dim_groups[d.name])}" for d in dims] + \
                [f"DP groups {_groups(groups.dp_groups)}"] + \
                ([f"EP groups {_groups(groups.ep_groups)}; expert gradients over "
                  f"{_groups(groups.expert_data_groups)}"] if self.ep > 1 else []) + \
                ([f"gradients averaged over {_groups(groups.replica_groups)}"] if self.replicas > self.dp else []) + \
                ([f"pipelines (stage 0 first) {_groups(groups.pp_groups)}"] if self.pp > 1 else []) + \
                ([f"ZeRO shards over {_groups(groups.shard_groups)}, replicated over "
                  f"{_groups(groups.replicate_groups)}"] if s else [])
        if self.ep > 1:
            sizes = sizes.replace(f"dp {self.dp}", f"dp {self.dp} (ep {self.ep})")
        return f"{sizes}: {'; '.join(parts)}"


@dataclass
class Axis:
    """This process's place along an extra dimension: its size, rank along it, group and the group's ranks."""

    name: str
    size: int
    rank: int
    group: dist.ProcessGroup | None
    ranks: list[int]
    replicates: bool = False


def build_mesh(tp: int = 1, dp: int | None = None, pp: int = 1, cp: int = 1, ep: int = 1,
               dims: tuple[Dim, ...] = (), dp_shard: int = 0) -> Mesh:
    """The mesh of this process (collective when tp, pp, cp, ep, an extra dimension or hybrid sharding's
    ``dp_shard`` is above 1: every rank calls it, in the same order)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims = tuple(d for d in dims if d.size > 1)
    groups = layout(world, tp, pp, cp, ep, dims, dp_shard)
    hybrid = bool(groups.shard_groups) and len(groups.shard_groups[0]) < len(groups.replica_groups[0])
    model = tp * pp * cp * math.prod(d.size for d in dims)
    if dp is not None and dp * model != world:
        extra = "".join(f" x `{k}` {v}" for k, v in (("cp", cp), ("pp", pp), *((d.name, d.size) for d in dims))
                        if v > 1)
        raise ConfigError(f"`tp` {tp} x dp {dp}{extra} = {dp * model} processes, but the world has {world}: "
                          f"make the product equal the number of processes")

    def mine(kind: list[list[int]]) -> list[int]:
        return next(g for g in kind if rank in g)

    replicated = cp > 1 or any(d.replicates for d in dims)
    made: dict[str, dist.ProcessGroup | None] = {"tp": None, "cp": None, "dp": None, "replica": None, "pp": None,
                                                 "ep": None, "expert_data": None, **{d.name: None for d in dims}}
    made.update(shard=None, replicate=None)
    if world > 1 and (model > 1 or ep > 1 or hybrid):
        # new_group is collective over the whole world: every rank creates every group, in one order
        for kind, kind_groups, needed in (
                ("tp", groups.tp_groups, tp > 1), ("cp", groups.cp_groups, cp > 1),
                *((d.name, groups.dim_groups[d.name], True) for d in dims),
                ("dp", groups.dp_groups, model > 1), ("replica", groups.replica_groups, replicated),
                ("pp", groups.pp_groups, pp > 1), ("ep", groups.ep_groups, ep > 1),
                ("expert_data", groups.expert_data_groups, ep > 1),
                ("shard", groups.shard_groups, hybrid), ("replicate", groups.replicate_groups, hybrid)):
            for g in kind_groups if needed else ():
                pg = dist.new_group(g)
                if rank in g:
                    made[kind] = pg
    tp_ranks, dp_ranks, pp_ranks = mine(groups.tp_groups), mine(groups.dp_groups), mine(groups.pp_groups)
    cp_ranks = mine(groups.cp_groups)
    axes = {d.name: Axis(d.name, d.size, mine(groups.dim_groups[d.name]).index(rank), made[d.name],
                         mine(groups.dim_groups[d.name]), d.replicates) for d in dims}
    return Mesh(rank, world, tp, world // model, tp_ranks.index(rank), dp_ranks.index(rank), made["tp"],
                made["dp"], tp_ranks, dp_ranks, pp, pp_ranks.index(rank), made["pp"], pp_ranks,
                cp, cp_ranks.index(rank), made["cp"], cp_ranks,
                made["replica"], mine(groups.replica_groups) if replicated else None,
                ep, mine(groups.ep_groups).index(rank), made["ep"], mine(groups.ep_groups),
                made["expert_data"], mine(groups.expert_data_groups), axes,
                *((made["shard"], mine(groups.shard_groups), made["replicate"], mine(groups.replicate_groups))
                  if hybrid else ()))
