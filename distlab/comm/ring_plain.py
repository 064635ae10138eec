"""The ring all-reduce as the algorithm reads (Patarasuk & Yuan 2009), nothing else: the buffer in ``n`` chunks;
``n-1`` reduce-scatter steps, each sending one chunk to the right neighbour while receiving another from the left
and adding it in, after which rank ``r`` holds chunk ``r``'s sum; then ``n-1`` all-gather steps passing the
finished chunks on. ``2(n-1)/n`` of the buffer leaves each rank. ``--collective ring_plain``; :mod:`distlab.comm.ring`
is the same schedule made fast (segments streamed, receives posted ahead), and ``tests/test_comm.py`` holds the two
to each other."""

from __future__ import annotations

import torch

from distlab.comm import chunked
from distlab.comm.ops import combine
from distlab.comm.p2p import exchange, irecv, isend, wait_all


def reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, group, rank: int, n: int) -> None:
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send, recv = (rank - step - 1) % n, (rank - step - 2) % n  # after the last step: chunk ``rank``
        got = incoming[:chunks[recv].numel()]
        exchange(chunks[send], right, got, left, group)
        combine(op, chunks[recv], got)


def all_gather_chunks(chunks: list[torch.Tensor], group, rank: int, n: int) -> None:
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send, recv = (rank - step) % n, (rank - step - 1) % n
        exchange(chunks[send], right, chunks[recv], left, group)


all_reduce, reduce_scatter, all_gather = chunked.build(reduce_scatter_chunks, all_gather_chunks)


def broadcast(buf: torch.Tensor, src: int, group, rank: int, n: int) -> None:
    """Passed round the ring from ``src``: each rank receives it from its left and sends it on to its right."""
    right, left = (rank + 1) % n, (rank - 1) % n
    if rank != src:
        wait_all([irecv(buf, left, group)])
    if right != src:
        wait_all([isend(buf, right, group)])
