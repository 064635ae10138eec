"""A solution of examples/exercises/gradient_sync.py (distlab's allreduce sync, without its options)."""

import torch
from torch import nn

from distlab import comm
from distlab.parallel import SyncMethod


class MySync(SyncMethod):
    def sync(self, module: nn.Module) -> None:
        for p in module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                comm.all_reduce(p.grad, op="avg", algorithm=self.collective, group=self.group)
