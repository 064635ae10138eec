"""Data parallel's gradient-sync methods, registered by name (:class:`~distlab.parallel.data_parallel.DataParallel`
wraps a model with one).

Every rank holds the whole model and runs forward and backward on its own slice of the global
batch; a sync method then makes each rank's ``.grad`` the mean over the whole global batch, so
the optimizer step is the single-process step on that batch (see ``distlab.data.sampler`` for
why the slices make up the sequential minibatch). Methods (``--dp-sync``):

==================  ==========================================================================
``gather-scatter``  the parameter-server pattern: rank 0 gathers every rank's (flattened)
                    gradients, averages them and scatters the mean back. Rank 0 sends and
                    receives ``(n-1) x`` the gradients: it is the bottleneck, on purpose.
``allreduce``       after backward, one all-reduce per parameter. Simple; many small messages,
                    and no communication overlaps backward.
``bucketed``        parameters grouped in reverse registration order (roughly the order backward
                    produces their gradients) into buckets of ``bucket_mb``; a bucket is
                    flattened and all-reduced *asynchronously the moment its last gradient is
                    accumulated*, so communication overlaps the rest of backward. The optimizer
                    step waits for all buckets. What DDP does, in ~100 readable lines.
``ddp``             torch's ``DistributedDataParallel`` (its bucket size is ``bucket_mb``).
==================  ==========================================================================

``collective`` picks the all-reduce algorithm from :mod:`distlab.comm` (``native`` = gloo's /
NCCL's own; ``ring``, ``butterfly``, ``direct`` = distlab's). Under ``ddp`` a non-native
collective is installed as DDP's communication hook. ``gather-scatter`` is itself the
communication pattern, so it takes no other collective.

A method is a class with ``wrap(module)``, ``sync(module)`` and ``no_sync(module)``; adding one
is a class plus a line in
:data:`distlab.parallel.data_parallel.SYNC_METHODS`. ``no_sync()`` (gradient accumulation) makes backward
accumulate locally and communicate nothing.

The four methods sit side by side here -- what each sends, in which order, and why it is the mean.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from distlab import comm
from distlab.runtime import timeline
from distlab.comm.accounting import allreduce_bytes_per_rank
from distlab.errors import ConfigError
from distlab.parallel.compression import Codec, bytes_per_rank

def module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")



COLLECTIVES = ("native", "ring", "butterfly", "direct")


def grad_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients data parallel averages: all that train, but those replicated
    over a group of their own (``sync_group``: expert-parallel shards, reduced by their owner)."""
    return [p for p in module.parameters() if p.requires_grad and not hasattr(p, "sync_group")]


def grad_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in grad_params(module))


class SyncMethod:
    """Base: how a data-parallel wrapper makes gradients the global mean."""

    name = "base"
    collectives: tuple[str, ...] | None = None  # the algorithms it works with (None: every one comm has)

    def __init__(self, group: dist.ProcessGroup | None = None, collective: str = "native",
                 codec: Codec | None = None, **options):
        self.group = group
        self.codec = codec if codec is not None else Codec()  # exact unless compression or a reduce dtype
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        collective = comm.ALIASES.get(collective, collective)
        if collective == "auto":  # an all-reduce: the backend's own is the fastest (comm.resolve)
            collective = "native"
        collective = comm.check_algorithm(collective)
        if self.collectives is not None and collective not in self.collectives:
            raise ConfigError(f"`dp_sync` {self.name} cannot use `collective` {collective!r}; it works with: "
                              f"{', '.join(self.collectives)}")
        self.collective = collective

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def sync(self, module: nn.Module) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module) -> Iterator[None]:
        yield

    def bytes_per_sync(self, module: nn.Module) -> int | None:
        """Bytes each rank sends in one gradient sync (the textbook volume of the pattern)."""
        if not self.codec.exact:
            return bytes_per_rank(self.codec, [p.shape for p in grad_params(module)], self.world_size)
        return allreduce_bytes_per_rank(grad_bytes(module), self.world_size)

    def state_dict(self) -> dict:
        """What the sync carries from step to step (a compressing codec's memory), for snapshots."""
        codec = self.codec.state_dict()
        return {"codec": codec} if codec else {}

    def load_state_dict(self, state: dict) -> None:
        if "codec" in state:
            self.codec.load_state_dict(state["codec"])

    def uncounted_bytes(self, module: nn.Module) -> int:
        """Bytes per sync that :mod:`distlab.comm`'s accounting cannot see (0: it sees them all)."""
        return 0


class AllReduceSync(SyncMethod):
    """After backward, all-reduce (average) each parameter's gradient.

    ``len(parameters)`` collectives per step, each of one parameter's size; a parameter that got
    no gradient on this rank contributes zeros, so every rank issues the same collectives.
    """

    name = "allreduce"

    @torch.no_grad()
    def sync(self, module: nn.Module) -> None:
        if self.world_size == 1:
            return
        with timeline.span("all-reduce per parameter", "communication"):
            self._sync(module)

    def _sync(self, module: nn.Module) -> None:
        for i, p in enumerate(grad_params(module)):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.codec.exact:
                comm.all_reduce(p.grad, op="avg", algorithm=self.collective, group=self.group)
                continue
            flat = p.grad.reshape(-1)
            self.codec.all_reduce_mean(flat, [p.shape], i, self.collective, self.group)
            if flat.data_ptr() != p.grad.data_ptr():
                p.grad.copy_(flat.view_as(p.grad))


def flatten_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def unflatten_into_grads(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = view.to(p.dtype, copy=True)
        else:
            p.grad.copy_(view)
        offset += p.numel()


class GatherScatterSync(SyncMethod):
    """The parameter server: ``gather`` all gradients (one flat buffer per rank) to rank 0, which
    sums them and divides by the world size; ``scatter`` sends the mean back to every rank.

    Uses torch's ``gather`` / ``scatter`` collectives. Rank 0 receives and sends ``(n-1) x S``
    bytes while every other rank moves ``S`` each way, so rank 0's link bounds the step.
    """

    name = "gather-scatter"
    collectives = ("native",)

    @torch.no_grad()
    def sync(self, module: nn.Module) -> None:
        if self.world_size == 1:
            return
        with timeline.span("gather to rank 0, scatter the mean", "communication"):
            self._sync(module)

    def _sync(self, module: nn.Module) -> None:
        params = grad_params(module)
        flat = flatten_grads(params)
        rank = dist.get_rank(self.group)
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)] if rank == 0 else None
        comm.gather(flat, gathered, dst=0, group=self.group)
        scatter_list = [torch.stack(gathered).sum(0).div_(self.world_size)] * self.world_size if rank == 0 else None
        comm.scatter(flat, scatter_list, src=0, group=self.group)
        unflatten_into_grads(flat, params)

    def bytes_per_sync(self, module: nn.Module) -> int | None:
        """Rank 0's volume (the bottleneck): it sends the mean to ``n-1`` ranks."""
        return (self.world_size - 1) * grad_bytes(module)
