"""Ring all-reduce (Patarasuk & Yuan 2009; Baidu's "ring allreduce"): reduce-scatter, then all-gather.

The buffer is cut into ``n`` chunks (sizes differ by at most one element). In each of the ``n-1``
reduce-scatter steps every rank sends one chunk to its right neighbour while it receives another
from its left and adds it in; after them rank ``r`` holds the full reduction of chunk ``r``. The
``n-1`` all-gather steps pass the finished chunks round the ring. Each rank sends
``2(n-1)/n * S`` bytes -- bandwidth-optimal, independent of ``n`` -- in ``2(n-1)`` steps.

Making it fast (the plain version above spends its time waiting):

* **One schedule for both phases.** At step ``s`` of ``2(n-1)`` a rank sends chunk
  ``(rank-s-1) % n`` and receives chunk ``(rank-s-2) % n``; what it receives at step ``s`` is
  exactly what it sends at step ``s+1`` (added into its own copy during the reduce-scatter).
* **Segments, streamed.** Each chunk is cut into segments of about ``SEGMENT_BYTES``, and the
  ``2(n-1) x segments`` messages form one stream: the moment segment ``k`` of step ``s`` arrives
  (and is added in), it goes out again as segment ``k`` of step ``s+1``. Reductions overlap the
  transfers of later segments, and a large chunk no longer waits for its whole self to arrive.
* **Receives posted early.** gloo (like MPI's rendezvous protocol) only moves a large message once
  the receiver has posted its receive; a receive posted late costs a round trip of notices
  between the two processes' network threads. Every receive is posted before the first send:
  the reduce-scatter's into a rotating scratch buffer ``WINDOW`` messages ahead, the all-gather's
  straight into their final place (their own tag keeps them apart).
* **Little Python per message.** With 4-8 processes on 2 cores the ring is CPU-bound, and every
  microsecond of Python per message is CPU that gloo's C++ ring does not spend: the connection
  and tags are resolved once per neighbour (:class:`~distlab.comm.p2p.Peer`), every view is cut
  before the loop, and messages go to the process group objects directly, not through
  ``dist.isend``'s checks.
* **No duplex partner from 3 ranks on.** In a ring of 3 or more no two ranks send to each other,
  so each of the group's connections already carries one direction; routing the wrap-around pair
  over :mod:`~distlab.comm.p2p`'s second group only woke a second network thread in two of the
  processes. Two ranks still use it.

What each choice measured on a 2-core machine: ``docs/01-collectives.md`` ("How the ring was tuned").
"""

from __future__ import annotations

import math

import torch

from distlab.comm import chunked, p2p
from distlab.comm.ops import combiner, finish, workspace
from distlab.comm.p2p import irecv, isend, wait_all

SEGMENT_BYTES = 4 << 20  # segments of at most this much: fewer, larger messages cost less CPU
WINDOW = 8  # reduce-scatter receives posted ahead of the one being waited on
_RS_TAG, _AG_TAG = 0, 1


def _segments(chunks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Cut every chunk into the same number of segments (all ranks compute the same split)."""
    per_chunk = max(1, math.ceil(chunks[0].numel() * chunks[0].element_size() / SEGMENT_BYTES))
    if per_chunk == 1:
        return [[c] for c in chunks]
    return [list(torch.tensor_split(c, per_chunk)) for c in chunks]


def _stream(chunks: list[torch.Tensor], op: str | None, group, rank: int, n: int,
            first: int, last: int) -> None:
    """Run steps ``first..last-1`` of the ``2(n-1)``-step ring on ``chunks``.

    Steps ``< n-1`` reduce (``op``) what they receive into the chunk; later steps copy (receive in
    place). Step ``s`` sends chunk ``(rank-s-1) % n`` right and receives chunk ``(rank-s-2) % n``
    from the left. Messages are numbered ``m = (s - first) * per + k`` (segment ``k``). Every view
    is cut and every receive posted before the first send, so the loop does nothing but wait,
    reduce and pass on -- Python's cost per message is what this ring pays beyond gloo's C++ one.
    """
    duplex = n == 2  # from 3 ranks on, every connection carries one direction of the ring anyway
    right, left = p2p.Peer(group, (rank + 1) % n, duplex), p2p.Peer(group, (rank - 1) % n, duplex)
    seg = _segments(chunks)
    per = len(seg[0])
    total = (last - first) * per
    if total == 0:
        return
    n_rs = max(0, min(last, n - 1) - first) * per  # messages that are reduced in, not copied
    into = [seg[(rank - first - m // per - 2) % n][m % per] for m in range(total)]  # where m ends up
    recvs: list = [None] * total
    window = min(WINDOW, n_rs)
    if window:  # reduce-scatter receives land in a rotating scratch buffer, WINDOW messages ahead
        size = seg[0][0].numel()  # segment 0 is the largest
        scratch = workspace(window * size, seg[0][0]).view(window, size)
        slots = [scratch[m % window][: into[m].numel()] for m in range(n_rs)]
        for m in range(window):
            recvs[m] = left.irecv(slots[m], _RS_TAG)
        reduce = combiner(op)
    for m in range(n_rs, total):  # all-gather receives go straight to their final place
        recvs[m] = left.irecv(into[m], _AG_TAG)
    step_tag = _RS_TAG if first < n - 1 else _AG_TAG
    send = right.isend
    sends = [send(seg[(rank - first - 1) % n][k], step_tag) for k in range(per)]  # ready now
    for m in range(total):
        work = recvs[m]
        if work is not None:
            work.wait()
        if m < n_rs:
            reduce(into[m], slots[m])
            if m + window < n_rs:  # its scratch slot is free again
                recvs[m + window] = left.irecv(slots[m + window], _RS_TAG)
        if m + per < total:  # what just arrived goes out as the next step's segment
            sends.append(send(into[m], _RS_TAG if m + per < n_rs else _AG_TAG))
    wait_all(sends)


def reduce_scatter_chunks(chunks: list[torch.Tensor], op: str, group, rank: int, n: int) -> None:
    """Afterwards ``chunks[rank]`` is the reduction over all ranks (the other chunks are partial)."""
    _stream(chunks, op, group, rank, n, 0, n - 1)


def all_gather_chunks(chunks: list[torch.Tensor], group, rank: int, n: int) -> None:
    """Starting with ``chunks[rank]`` final on each rank, make every chunk final everywhere."""
    _stream(chunks, None, group, rank, n, n - 1, 2 * (n - 1))


def _all_reduce_chunks(chunks: list[torch.Tensor], op: str, group, rank: int, n: int) -> None:
    _stream(chunks, op, group, rank, n, 0, 2 * (n - 1))


_, reduce_scatter, all_gather = chunked.build(reduce_scatter_chunks, all_gather_chunks)


def all_reduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    """Both phases as one stream, so the all-gather starts segment by segment as chunks finish."""
    _all_reduce_chunks(list(torch.tensor_split(buf, n)), op, group, rank, n)
    finish(op, buf, n)


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
