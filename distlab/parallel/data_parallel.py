"""Data parallel: one wrapper, gradient-sync methods registered by name.

Every rank holds the whole model and runs forward and backward on its own slice of the global
batch; a sync method then makes each rank's ``.grad`` the mean over the whole global batch, so
the optimizer step is the single-process step on that batch (see ``distlab.data.sampler`` for
why the slices make up the sequential minibatch). Methods:

``allreduce``  after backward, one all-reduce (SUM) per parameter, then divide by the world
               size. Simple and readable; communication does not overlap backward.
``ddp``        torch's ``DistributedDataParallel``: bucketed all-reduce overlapped with backward.

A method is a class with ``wrap(module)``, ``sync(module)`` and ``no_sync(module)``; adding one
is a class plus a line in ``SYNC_METHODS``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from distlab.comm.accounting import allreduce_bytes_per_rank
from distlab.runtime import broadcast_module


class GradSync:
    """Base: how a data-parallel wrapper makes gradients the global mean."""

    name = "base"

    def __init__(self, group: dist.ProcessGroup | None = None, **options):
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def sync(self, module: nn.Module) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module) -> Iterator[None]:
        yield

    def bytes_per_sync(self, module: nn.Module) -> int | None:
        """Bytes each rank sends in one gradient sync (analytic for native collectives)."""
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        return allreduce_bytes_per_rank(nbytes, self.world_size)


class AllReduceSync(GradSync):
    """After backward, ``all_reduce(SUM)`` each parameter's gradient and divide by the world size.

    ``len(parameters)`` collectives per step, each of one parameter's size; a parameter that got
    no gradient on this rank contributes zeros, so every rank issues the same collectives.
    """

    name = "allreduce"

    @torch.no_grad()
    def sync(self, module: nn.Module) -> None:
        if self.world_size == 1:
            return
        for p in module.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
            p.grad.div_(self.world_size)


class TorchDDPSync(GradSync):
    """torch's ``DistributedDataParallel`` (Li et al., VLDB 2020): gradients are all-reduced in
    buckets of ``bucket_mb`` MB during backward, overlapping communication with computation."""

    name = "ddp"

    def __init__(self, group=None, bucket_mb: float = 25.0, find_unused: bool = False, **options):
        super().__init__(group)
        self.bucket_mb = bucket_mb
        self.find_unused = find_unused

    def wrap(self, module: nn.Module) -> nn.Module:
        device_ids = [module_device(module).index] if module_device(module).type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, process_group=self.group, bucket_cap_mb=self.bucket_mb,
            find_unused_parameters=self.find_unused)

    def sync(self, module: nn.Module) -> None:
        pass  # DDP already reduced during backward

    def no_sync(self, module: nn.Module):
        return module.no_sync()


SYNC_METHODS: dict[str, type[GradSync]] = {
    "allreduce": AllReduceSync,
    "ddp": TorchDDPSync,
}


def module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training with the sync method ``method``.

    Construction broadcasts rank 0's parameters and buffers, so replicas start equal. Call
    ``sync_gradients()`` after ``backward()`` and before ``optimizer.step()``; inside
    ``no_sync()`` backward accumulates locally and communicates nothing.
    """

    def __init__(self, module: nn.Module, method: str = "allreduce", group: dist.ProcessGroup | None = None,
                 broadcast: bool = True, **options):
        super().__init__()
        if method not in SYNC_METHODS:
            from distlab.errors import ConfigError
            raise ConfigError(f"unknown --dp-sync {method!r}; choose one of: {', '.join(SYNC_METHODS)}")
        if broadcast:
            broadcast_module(module, src=0, group=group)
        self.method = SYNC_METHODS[method](group, **options)
        self.wrapped = self.method.wrap(module)
        self._module = [module]  # not a submodule twice: state_dict keys stay those of `module`

    @property
    def module(self) -> nn.Module:
        """The plain model (its ``state_dict`` has the single-process keys)."""
        return self._module[0]

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def sync_gradients(self) -> None:
        self.method.sync(self.module)

    def no_sync(self):
        return self.method.no_sync(self.wrapped)

    def bytes_per_sync(self) -> int | None:
        return self.method.bytes_per_sync(self.module)
