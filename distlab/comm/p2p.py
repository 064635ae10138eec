"""Point-to-point messages in group ranks, counted by the accounting module.

Every distlab algorithm talks through these four functions and nothing else. Peers are ranks
*within* ``group``; zero-element tensors are not sent (both sides know the sizes and skip alike).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.comm import accounting


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None):
    if t.numel() == 0:
        return None
    accounting.record_send(t.numel() * t.element_size())
    return dist.isend(t, _global(group, dst), group=group)


def irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None):
    if t.numel() == 0:
        return None
    accounting.record_recv(t.numel() * t.element_size())
    return dist.irecv(t, _global(group, src), group=group)


def wait_all(works) -> None:
    """Wait for every request (in order); a dead peer raises within the group's timeout."""
    for w in works:
        if w is not None:
            w.wait()


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
             group: dist.ProcessGroup | None = None) -> None:
    """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` with both in flight together."""
    wait_all([irecv(recv, src, group), isend(send, dst, group)])
