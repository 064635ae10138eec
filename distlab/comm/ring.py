"""Ring all-reduce (Patarasuk & Yuan 2009; Baidu's "ring allreduce"): reduce-scatter, then all-gather.

The buffer is cut into ``n`` chunks (sizes differ by at most one element). In each of the ``n-1``
reduce-scatter steps every rank sends one chunk to its right neighbour while it receives another
from its left (both in flight together) and adds it in; after them rank ``r`` holds the full
reduction of chunk ``r``. The ``n-1`` all-gather steps pass the finished chunks round the ring.
Each rank sends ``2(n-1)/n * S`` bytes -- bandwidth-optimal, independent of ``n`` -- in
``2(n-1)`` latency-bound steps.
"""

from __future__ import annotations

import torch

from distlab.comm import chunked
from distlab.comm.ops import combine
from distlab.comm.p2p import exchange, irecv, isend, wait_all


def reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, group, rank: int, n: int) -> None:
    """Afterwards ``chunks[rank]`` is the reduction over all ranks (the other chunks are partial)."""
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty_like(chunks[0])  # tensor_split puts the largest chunks first
    for s in range(n - 1):
        send_i, recv_i = (rank - s - 1) % n, (rank - s - 2) % n
        tmp = scratch[: chunks[recv_i].numel()]
        exchange(chunks[send_i], right, tmp, left, group)
        combine(op, chunks[recv_i], tmp)


def all_gather_chunks(chunks: list[torch.Tensor], group, rank: int, n: int) -> None:
    """Starting with ``chunks[rank]`` final on each rank, make every chunk final everywhere."""
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        exchange(chunks[(rank - s) % n], right, chunks[(rank - s - 1) % n], left, group)


all_reduce, reduce_scatter, all_gather = chunked.build(reduce_scatter_chunks, all_gather_chunks)


def broadcast(buf: torch.Tensor, src: int, group, rank: int, n: int) -> None:
    """A chain from ``src`` round the ring, pipelined in ``n`` chunks (each rank forwards as it gets)."""
    pos = (rank - src) % n  # position in the chain
    right, left = (rank + 1) % n, (rank - 1) % n
    sends = []
    for chunk in torch.tensor_split(buf, n):
        if pos > 0:
            wait_all([irecv(chunk, left, group)])
        if pos < n - 1:
            sends.append(isend(chunk, right, group))
    wait_all(sends)
