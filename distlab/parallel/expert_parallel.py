"""Expert parallel: a mixture of experts' experts sharded over ``ep`` data-parallel ranks.

Each of the ``ep`` ranks of an EP group keeps ``E / ep`` experts (rank ``r``: experts
``r E/ep .. (r+1) E/ep - 1``) and its own tokens, as data parallel gives them. In every MoE
layer the router (replicated) picks each token's experts; the token-slots, already sorted by
expert, go to the ranks holding their experts in one all-to-all (GShard's dispatch), each rank
runs its experts on what arrived from every rank, and a second all-to-all brings the outputs
home (combine), where the gates weight them. Backward runs the same two exchanges in reverse.
Sizes vary per step (routing decides them), so the per-expert counts travel first, in a small
all-to-all of their own. Per layer and rank (:func:`exchange_bytes`): the slots it routes to other
ranks' experts go out and the outputs of the slots other ranks routed to it go back, forward; the
same rows' gradients travel the other way in backward; with balanced routing about
``4 (ep - 1)/ep x slots x d`` elements. :mod:`distlab.comm` counts every byte.

**Gradients.** The experts are not replicas across the EP group, so the data-parallel sync
leaves them out (each carries ``sync_group``: the group it is replicated over). After backward
an expert's gradient on its rank holds every EP rank's tokens' contributions, each scaled by its
own rank's ``1 / local batch``; :meth:`ExpertParallel.sync_gradients` sums it over the
*expert-data group* (the replicas of the same shard: same ``dp_rank mod ep``, every context-
parallel rank) and divides by the number of replicas of the whole model, which makes it the
single-process mean over the global batch, exactly as data parallel does for the rest.

**State.** The shard keeps the stacked expert tensors' names, split along dimension 0 over the EP
group (``tp_split``, as a tensor-parallel layer), so full state dicts, snapshots and resharding
gather and cut experts like any split parameter: a snapshot taken at one ``ep`` resumes at another.

A model joins by declaring ``expert_parallel_plan(ep)``: ``{module name: "experts"}`` for each
module that computes its experts from ``(tokens sorted by expert, counts per expert)`` with
parameters stacked along a first dimension of size ``experts``
(:class:`distlab.models.moe.GroupedExperts`).
"""

from __future__ import annotations

import torch
from torch import nn

from distlab import comm
from distlab.comm import p2p
from distlab.errors import ConfigError
from distlab.models import plans
from distlab.parallel.expert_dispatch_plain import dispatch as all_gather_dispatch
from distlab.parallel.cost import Call, CallGroup, Price, in_stage, under
from distlab.parallel.protocols import split_shape
from distlab.parallel.tensor_parallel.mappings import all_gather_along
from distlab.parallel.protocols import ComponentKind
from distlab.runtime import broadcast_module, group_rank, group_size, timeline
from distlab.runtime.eager import eager

DISPATCHES = ("all_to_all", "all_gather")  # all_gather: the plain dispatch (expert_dispatch_plain)

def _all_to_all(chunks: list[torch.Tensor], sizes: list[int], group, rank: int) -> list[torch.Tensor]:
    """Chunk ``j`` to rank ``j``; returns what rank ``j`` sent this one (``sizes[j]`` rows each)."""
    first = chunks[rank]
    out = [first.new_empty((s, *first.shape[1:])) for s in sizes]
    out[rank] = first
    works = [p2p.irecv(out[j], j, group) for j in range(len(sizes)) if j != rank and sizes[j]]
    works += [p2p.isend(chunks[j].contiguous(), j, group) for j in range(len(chunks)) if j != rank and len(chunks[j])]
    with timeline.span(f"expert all-to-all {timeline.size_text(sum(c.numel() * c.element_size() for c in chunks))}",
                       "communication"):
        p2p.wait_all(works)
    return out


class _Exchange(torch.autograd.Function):
    """Rows ``send[j]`` of ``x`` (in order) to rank ``j``; returns the rows every rank sent here, in
    rank order. Backward: the reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, send, recv, group, rank):
        ctx.args = (send, recv, group, rank)
        return torch.cat(_all_to_all(list(x.split(send)), recv, group, rank))

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, rank = ctx.args
        return _Exchange.apply(grad.contiguous(), recv, send, group, rank), None, None, None, None


class ExpertShard(nn.Module):
    """This rank's ``E / ep`` experts of ``experts`` (same parameter names, split along dimension 0),
    exchanging tokens with the other ranks of ``group`` (module docstring; ``dispatch`` all_gather: the plain
    dispatch of :mod:`distlab.parallel.expert_dispatch_plain`)."""

    def __init__(self, experts: nn.Module, group, sync_group=None, dispatch: str = "all_to_all"):
        super().__init__()
        params = dict(experts.named_parameters(recurse=False))
        if not params or any(p.dim() == 0 for p in params.values()):
            raise ConfigError(f"expert parallel: {type(experts).__name__} must hold its experts stacked along a first "
                              f"dimension; it has {', '.join(params) or 'no parameters'}")
        total = next(iter(params.values())).shape[0]
        n, r = group_size(group), group_rank(group)
        if any(p.shape[0] != total for p in params.values()):
            raise ConfigError(f"expert parallel: the parameters of {type(experts).__name__} disagree on the number of "
                              f"experts (first dimensions {[tuple(p.shape)[0] for p in params.values()]})")
        if total % n:
            raise ConfigError(f"expert parallel shards {total} experts over `ep` {n} ranks: choose an `ep` that divides "
                              f"{total} (or a number of experts that {n} divides)")
        self.group, self.ep, self.ep_rank, self.num_experts, self.local = group, n, r, total, total // n
        self.dispatch = dispatch
        self.tp_split = dict.fromkeys(params, 0)  # snapshots and full state dicts gather along it
        self._compute = type(experts).forward  # the experts' own computation, run on this shard's slices
        for name, p in params.items():
            shard = nn.Parameter(p.detach()[r * self.local:(r + 1) * self.local].clone(), requires_grad=p.requires_grad)
            shard.sync_group = sync_group  # replicated over the expert-data group, not the data-parallel group
            self.register_parameter(name, shard)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return split_shape(self, name)

    def full_parameters(self) -> list[torch.Tensor]:
        """Every expert's tensors, gathered from the EP group (collective)."""
        return [all_gather_along(p.detach(), self.group, 0) for p in self.parameters(recurse=False)]

    @eager  # a collective: run as it is under --compile (a graph break), never traced
    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        n, local, rank = self.ep, self.local, self.ep_rank
        if len(counts) != self.num_experts:
            raise ValueError(f"expert parallel: {len(counts)} counts for {self.num_experts} experts")
        if self.dispatch == "all_gather":
            return all_gather_dispatch(self, tokens, counts)
        # row j: slots for rank j's experts (on the tokens' device: NCCL sends device tensors only)
        mine = torch.tensor(counts, dtype=torch.int64, device=tokens.device).view(n, local)
        theirs = torch.cat(_all_to_all(list(mine.split(1)), [1] * n, self.group, rank))  # row j: from rank j
        send, recv = mine.sum(1).tolist(), theirs.sum(1).tolist()
        arrived = _Exchange.apply(tokens, send, recv, self.group, rank)  # by source rank, then expert
        starts = (torch.cumsum(theirs.flatten(), 0) - theirs.flatten()).view(n, local).tolist()
        sizes = theirs.tolist()
        by_expert = [torch.arange(starts[s][e], starts[s][e] + sizes[s][e]) for e in range(local) for s in range(n)]
        perm = torch.cat(by_expert).to(tokens.device) if by_expert else torch.zeros(0, dtype=torch.long)
        out = self._compute(self, arrived.index_select(0, perm), theirs.sum(0).tolist())
        if not len(arrived):  # nothing came: keep `arrived` in the graph, or this rank's backward would skip
            out = out + arrived.sum()  # the dispatch's exchange that every other rank runs (0: empty)
        home = torch.zeros_like(out).index_copy(0, perm, out)  # back to arrival order
        return _Exchange.apply(home, recv, send, self.group, rank)


class ExpertParallel(ComponentKind):
    """The expert shards of a model and their gradient reduction (module docstring); as a component
    kind (:mod:`distlab.parallel.components`), ``ep=N`` over the mesh's expert-parallel group."""

    name = dim = "ep"

    @staticmethod
    def check(model: nn.Module, strategy, input_shape: tuple[int, ...]) -> None:
        """Before launch, on the model built on the meta device: it names its experts, and its own
        limits hold (the model raises, naming them: say, experts that `ep` does not divide)."""
        plan_of(model, strategy.ep)

    @staticmethod
    def price(t, t_rank, lay, micro: int, optim) -> Price:
        """On the model's trace: each rank keeps ``1 / ep`` of the experts (their parameters, gradients
        and optimizer state), and per MoE layer and micro-batch, with balanced routing, sends
        :func:`exchange_bytes` -- ``(ep - 1)/ep`` of its token-slots out and as many outputs back, their
        gradients the other way, and the per-expert counts -- on the critical path of every MoE layer."""
        if not t.expert_names:
            raise ConfigError(f"`ep` {lay.ep}: expert parallel shards a mixture of experts' experts, and this model "
                              f"declares none (expert_parallel_plan); plan it with `ep` 1")
        if lay.strategy.ep_dispatch != "all_to_all":
            raise ConfigError(f"`ep_dispatch` {lay.strategy.ep_dispatch} is not planned: plan the all-to-all dispatch "
                              f"(`ep_dispatch` all_to_all), which the plain one is held equal to")
        ep = lay.ep
        mine = {name: v for name, v in t.expert_slots.items() if in_stage(name, t_rank, lay)} if t.expert_slots else {}
        # (sequence parallel: each tensor-parallel rank routes its own T / tp positions)
        split = lay.cp * (lay.tp if lay.strategy.sequence_parallel else 1)
        slots = (sum(mine.values()) if t.expert_slots else t.expert_slot_bytes_per_sample) * micro / split
        layers = len(mine) if t.expert_slots else len({n.rsplit(".", 1)[0] for n in t.expert_names})
        experts = t.shapes[t.names.index(t.expert_names[0])][0] if t.shapes else 0
        counts = layers * (ep - 1) * 8 * (experts // ep)  # each layer's per-expert counts, int64
        # activation checkpointing runs a checkpointed block's forward again in backward: its exchanges out and back
        recomputed = {name for block in lay.strategy.checkpointed(t.blocks) for name in block}
        again = [name for name in mine if under(name, recomputed)] if t.expert_slots else []
        slots += sum(mine[name] for name in again) * micro / split / 2  # (half of a layer's four crossings)
        counts += len(again) * (ep - 1) * 8 * (experts // ep)
        sent = lay.strategy.micro_steps * (4 * (ep - 1) / ep * slots + counts)
        local = not (lay.dp // ep == 1 and lay.cp == 1)
        # exact memory: the rank's trace holds 1 / ep of each expert tensor (pipeline.cost.stages), which the
        # gradient sync beside it counts whole (data parallel, or ZeRO holding them whole: zero.cost.whole_units)
        return Price([CallGroup([Call("native", "all_to_all", sent)], ep, local=local, dim="ep")], exact=True,
                     report={"expert_parallel": {
                         "ep": ep, "expert_share_per_rank": 1 / ep, "bytes_per_step_per_rank": int(sent),
                         "bytes_basis": "per MoE layer and micro-batch, with balanced routing: (ep - 1)/ep of the "
                                        "rank's token-slots out to other ranks' experts and as many outputs back, "
                                        "forward, and their gradients in backward (4 (ep - 1)/ep x slots x width), "
                                        "plus the per-expert counts",
                         "memory_basis": "experts' parameters, gradients and optimizer state / ep; the rest "
                                         "replicated"}})

    @staticmethod
    def describe(engine) -> list[str]:
        """The experts this rank holds, and how tokens reach the others."""
        ep, plain = engine.mesh.ep, engine.strategy.ep_dispatch == "all_gather"
        how = "all-gather and reduce-scatter (the plain dispatch)" if plain else "all-to-all"
        return [f"expert parallel: each mixture-of-experts layer's experts shared out over {ep} data-parallel "
                f"ranks (1/{ep} on each), tokens sent to them and back by {how}"]

    @staticmethod
    def apply(model: nn.Module, strategy, mesh) -> tuple[nn.Module, "ExpertParallel"]:
        return model, apply_expert_parallel(model, mesh.ep_group, mesh.expert_data_group, mesh.replicas,
                                            strategy.ep_dispatch)

    def __init__(self, shards: list[ExpertShard], data_group, replicas: int):
        self.shards, self.data_group, self.replicas = shards, data_group, replicas

    def parameters(self) -> list[nn.Parameter]:
        """The expert shards' parameters this rank holds (a pipeline stage's own layers': another stage's,
        in a model built on the meta device, never get values here)."""
        return [p for s in self.shards for p in s.parameters() if p.requires_grad and not p.is_meta]

    # -- the Engine's ModelSharding component: the batch as it is; the expert gradients reduced over
    # -- their own replicas after the sync; every forward exchanges tokens between data-parallel ranks
    lockstep = True

    def prepare_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors

    def reduce_gradients(self) -> None:
        self.sync_gradients()

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Expert gradients: summed over the expert-data group, divided by the model's replica count."""
        params = self.parameters()
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        if group_size(self.data_group) > 1:
            comm.all_reduce(flat, "sum", group=self.data_group)
        flat.div_(self.replicas)
        offset = 0
        for p in params:
            view = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
            offset += p.numel()


def plan_of(model: nn.Module, ep: int = 2) -> dict[str, str]:
    """``model``'s expert-parallel plan for ``ep`` ranks (:func:`distlab.models.plans.plan_of`)."""
    return plans.plan_of(model, "expert", ep=ep)


def apply_expert_parallel(model: nn.Module, group, data_group, replicas: int,
                          dispatch: str = "all_to_all") -> ExpertParallel:
    """Shard every module the model's plan names over ``group`` (in place); the shards start from
    the first replica's experts (a broadcast over ``data_group``, as data parallel starts from rank 0)."""
    shards = []
    for name in plan_of(model, group_size(group)):
        shard = ExpertShard(model.get_submodule(name), group, data_group, dispatch)
        broadcast_module(shard, src=0, group=data_group)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, shard)
        shards.append(shard)
    return ExpertParallel(shards, data_group, replicas)


def exchange_bytes(sent: int, received: int, dim: int, ep: int, local: int, itemsize: int = 4) -> int:
    """Bytes one rank sends in one MoE layer's forward and backward: the per-expert counts
    (``ep - 1`` messages of ``local`` int64s), then ``sent`` token-slots out to other ranks' experts
    and the ``received`` slots' outputs back (forward), and the same rows' gradients the other way
    (backward) -- ``2 (sent + received) x dim`` elements in all."""
    return (ep - 1) * local * 8 + 2 * (sent + received) * dim * itemsize
