"""ZeRO as the paper draws it, for any ``nn.Module``, and nothing else (``zero_impl=plain``): every trainable
parameter flattened, zero-padded to a multiple of the group's ``n`` ranks and cut in ``n`` equal shards; rank ``r``
keeps shard ``r`` and the optimizer steps only the shards. After backward each gradient is reduce-scattered (rank
``r`` receives the group's mean of shard ``r``); after the step the updated shards are all-gathered back into the
parameters. The stages differ only in what a rank holds between the steps:

* stage 1 -- the optimizer state of its shards; the full gradients are kept until the step is over;
* stage 2 -- and the gradients of its shards only: the full ones are dropped as soon as they are reduced;
* stage 3 -- and the parameters of its shards only: all gathered before the forward, dropped after the reduce.

:class:`~distlab.parallel.zero.Zero` is the same partition made fast (and ``tests/test_zero_plain.py`` holds the two
to each other): buckets reduce-scattered while backward still runs, stage 3 gathering one module at a time just
before its forward and its backward, with prefetch. The Engine's bookkeeping (snapshots, accounting) is
:class:`~distlab.parallel.zero.plain_state.PlainZeroState`; this file is the algorithm."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from distlab import comm
from distlab.parallel.zero.plain_state import PlainZeroState, implementation  # (the user's own: zero_impl=FILE.py:NAME)
from distlab.runtime import broadcast_module, group_rank, group_size


__all__ = ["PlainZero", "implementation"]


class PlainZero(PlainZeroState, nn.Module):
    def __init__(self, module: nn.Module, stage: int, group=None, collective: str = "auto"):
        super().__init__()
        broadcast_module(module, src=0, group=group)  # every rank starts from rank 0's weights
        self._module, self.stage, self.group, self.collective = module, stage, group, collective
        self.n, self.rank = group_size(group), group_rank(group)
        self.params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.whole = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]  # kept whole
        self.size = [-(-p.numel() // self.n) for _, p in self.params]  # elements per shard: ceil(numel / n)
        self.shards = [nn.Parameter(self._padded(p.detach(), s)[self.rank * s:(self.rank + 1) * s].clone())
                       for (_, p), s in zip(self.params, self.size)]
        self.shapes = {id(p): p.shape for _, p in self.params}
        self.present = True  # whether the full parameters are in place (stage 3: only from forward to the reduce)
        if stage == 3:
            self._drop_parameters()
            module.register_forward_pre_hook(lambda m, args: None if self.present else self._gather_parameters())

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def _padded(self, t: torch.Tensor, s: int) -> torch.Tensor:
        return F.pad(t.reshape(-1), (0, s * self.n - t.numel()))

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """After the step's last backward: each shard's gradient is the group's mean of it."""
        for (_, p), s, shard in zip(self.params, self.size, self.shards):
            grad = self._padded(p.grad if p.grad is not None else torch.zeros_like(p), s)
            shard.grad = torch.empty_like(shard)
            self.observe(grad)  # (the most a step holds: full gradients, one padded copy, stage 3's parameters)
            comm.reduce_scatter(shard.grad, grad, op="avg", algorithm=self.collective, group=self.group)
            if self.stage >= 2:
                p.grad = None
        if self.stage == 3:
            self._drop_parameters()

    @torch.no_grad()
    def after_step(self) -> None:
        """After ``optimizer.step()`` on the shards: stages 1-2 gather them back (stage 3 at its next forward)."""
        self.observe()  # (and the optimizer's state, made by its first step)
        for _, p in self.params:
            p.grad = None
        if self.stage < 3:
            self._gather_parameters()

    @torch.no_grad()
    def _gather_parameters(self, only: set[int] | None = None) -> None:
        """Every parameter's shards all-gathered into it (``only``: the parameters of those ids)."""
        for (_, p), s, shard in zip(self.params, self.size, self.shards):
            if only is None or id(p) in only:
                full = torch.empty(s * self.n, dtype=shard.dtype, device=shard.device)
                comm.all_gather(full, shard.detach(), algorithm=self.collective, group=self.group)
                p.data = full[:self.shapes[id(p)].numel()].view(self.shapes[id(p)])
        self.present = only is None

    def _drop_parameters(self, only: set[int] | None = None) -> None:  # each a zero of its shape, one element held
        for _, p in self.params:                                      # (never read: forward gathers)
            if only is None or id(p) in only:
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(self.shapes[id(p)])
        self.present = False

    def no_sync(self):
        return contextlib.nullcontext()  # backward only accumulates: nothing is sent before sync_gradients
