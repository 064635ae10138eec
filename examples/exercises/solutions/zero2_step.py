"""A solution of examples/exercises/zero2_step.py (graded by the test suite with the command there)."""

import torch

from distlab import comm
from distlab.parallel.zero.plain import PlainZero


class MyZero2(PlainZero):
    @torch.no_grad()
    def sync_gradients(self) -> None:
        for (_, p), s, shard in zip(self.params, self.size, self.shards):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            shard.grad = torch.empty_like(shard)
            comm.reduce_scatter(shard.grad, self._padded(grad, s), op="avg", algorithm=self.collective,
                                group=self.group)
            p.grad = None

    @torch.no_grad()
    def after_step(self) -> None:
        for (_, p), s, shard in zip(self.params, self.size, self.shards):
            full = torch.empty(s * self.n, dtype=shard.dtype, device=shard.device)
            comm.all_gather(full, shard.detach(), algorithm=self.collective, group=self.group)
            p.data = full[:p.numel()].view(self.shapes[id(p)])


class SumNotMean(MyZero2):
    """A mistake to be graded: the shards' gradients summed over the ranks, not averaged."""

    @torch.no_grad()
    def sync_gradients(self) -> None:
        super().sync_gradients()
        for shard in self.shards:
            shard.grad.mul_(self.n)
