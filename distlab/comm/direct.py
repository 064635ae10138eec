"""Direct all-reduce: one all-to-all reduce-scatter round and one all-to-all all-gather round.

Rank ``r`` owns chunk ``r``. Every rank sends each chunk straight to its owner, the owner reduces
the ``n`` copies (in rank order) and sends the result straight back to everyone. Two rounds,
``2(n-1)/n * S`` bytes per rank like the ring, but ``n-1`` messages in flight per round (some
others call this one "butterfly") and ``(n-1)/n * S`` of receive buffers.
"""

from __future__ import annotations

import torch

from distlab.comm import chunked
from distlab.comm.ops import combine, workspace
from distlab.comm.p2p import irecv, isend, wait_all


def reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, group, rank: int, n: int) -> None:
    mine = chunks[rank]
    others, k = [j for j in range(n) if j != rank], mine.numel()
    ws = workspace(len(others) * k, mine)
    incoming = {j: ws[i * k:(i + 1) * k] for i, j in enumerate(others)}
    works = [irecv(incoming[j], j, group) for j in incoming]
    works += [isend(chunks[j], j, group) for j in range(n) if j != rank]
    wait_all(works)
    for j in sorted(incoming):
        combine(op, mine, incoming[j])


def all_gather_chunks(chunks: list[torch.Tensor], group, rank: int, n: int) -> None:
    works = [irecv(chunks[j], j, group) for j in range(n) if j != rank]
    works += [isend(chunks[rank], j, group) for j in range(n) if j != rank]
    wait_all(works)


all_reduce, reduce_scatter, all_gather = chunked.build(reduce_scatter_chunks, all_gather_chunks)


def broadcast(buf: torch.Tensor, src: int, group, rank: int, n: int) -> None:
    """The root sends the whole buffer to every other rank."""
    if rank == src:
        wait_all([isend(buf, j, group) for j in range(n) if j != src])
    else:
        wait_all([irecv(buf, src, group)])
