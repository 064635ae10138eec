"""Gather/scatter through rank 0: the parameter-server pattern.

Every other rank sends its whole buffer to rank 0, which reduces the ``n`` copies in rank order
and sends the result back to each. Two steps, but rank 0 sends ``(n-1) * S`` bytes and receives as
much (everyone else ``S``): rank 0's link is the bottleneck, so time grows linearly with ``n``.
"""

from __future__ import annotations

import torch

from distlab.comm.ops import combine, finish
from distlab.comm.p2p import irecv, isend, wait_all

ROOT = 0


def all_reduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    if rank == ROOT:
        incoming = {j: torch.empty_like(buf) for j in range(n) if j != ROOT}
        wait_all([irecv(incoming[j], j, group) for j in incoming])
        for j in sorted(incoming):
            combine(op, buf, incoming[j])
        wait_all([isend(buf, j, group) for j in range(n) if j != ROOT])
    else:
        wait_all([isend(buf, ROOT, group)])
        wait_all([irecv(buf, ROOT, group)])
    finish(op, buf, n)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: str, group, rank: int, n: int,
                   scratch: bool = False) -> None:
    """Rank 0 gathers and reduces everything, then sends each rank only its chunk."""
    if rank == ROOT:
        acc = inp if scratch else inp.clone()
        incoming = {j: torch.empty_like(inp) for j in range(n) if j != ROOT}
        wait_all([irecv(incoming[j], j, group) for j in incoming])
        for j in sorted(incoming):
            combine(op, acc, incoming[j])
        chunks = acc.chunk(n) if acc.numel() else [acc] * n
        wait_all([isend(chunks[j].contiguous(), j, group) for j in range(n) if j != ROOT])
        out.copy_(chunks[ROOT])
    else:
        wait_all([isend(inp, ROOT, group)])
        wait_all([irecv(out, ROOT, group)])
    finish(op, out, n)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, rank: int, n: int) -> None:
    chunks = list(out.chunk(n)) if out.numel() else [out] * n
    chunks[rank].copy_(inp)
    if rank == ROOT:
        wait_all([irecv(chunks[j], j, group) for j in range(n) if j != ROOT])
        wait_all([isend(out, j, group) for j in range(n) if j != ROOT])
    else:
        wait_all([isend(inp, ROOT, group)])
        wait_all([irecv(out, ROOT, group)])


def broadcast(buf: torch.Tensor, src: int, group, rank: int, n: int) -> None:
    if rank == src:
        wait_all([isend(buf, j, group) for j in range(n) if j != src])
    else:
        wait_all([irecv(buf, src, group)])
