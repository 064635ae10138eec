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
  between the two processes' network threads. All all-gather receives land directly in their
  final place, so they are posted before anything is sent (their own tag keeps them apart from
  the reduce-scatter's); reduce-scatter receives land in a small rotating scratch buffer and are
  posted ``WINDOW`` messages ahead.
"""

from __future__ import annotations

import math

import torch

from distlab.comm import chunked
from distlab.comm.ops import combine, workspace
from distlab.comm.p2p import irecv, isend, wait_all

SEGMENT_BYTES = 4 << 20  # segments of at most this much (4 MiB: fewer, larger messages won on 2 cores)
EARLY_AG = True
WINDOW = 8  # reduce-scatter receives posted ahead of the one being waited on
_RS_TAG, _AG_TAG = 0, 1


def _segments(chunks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Cut every chunk into the same number of segments (all ranks compute the same split)."""
    per_chunk = max(1, math.ceil(chunks[0].numel() * chunks[0].element_size() / SEGMENT_BYTES))
    return [list(torch.tensor_split(c, per_chunk)) for c in chunks]


def _stream(chunks: list[torch.Tensor], op: str | None, group, rank: int, n: int,
            first: int, last: int) -> None:
    """Run steps ``first..last-1`` of the ``2(n-1)``-step ring on ``chunks``.

    Steps ``< n-1`` reduce (``op``) what they receive into the chunk; later steps copy (receive in
    place). Step ``s`` sends chunk ``(rank-s-1) % n`` right and receives chunk ``(rank-s-2) % n``
    from the left.
    """
    right, left = (rank + 1) % n, (rank - 1) % n
    seg = _segments(chunks)
    per = len(seg[0])
    rs_steps = max(0, min(last, n - 1) - first)  # reducing steps in this call
    total = (last - first) * per

    def where(m: int) -> tuple[int, int, int]:
        s, k = divmod(m, per)
        return first + s, k, (rank - first - s - 2) % n  # step, segment, chunk received

    # All-gather receives go straight to their final place: post them all now.
    recvs: dict[int, object] = {}

    def post_ag(m: int) -> None:
        if n_rs <= m < total and m not in recvs:
            _, k, c = where(m)
            recvs[m] = irecv(seg[c][k], left, group, tag=_AG_TAG)

    n_rs = rs_steps * per
    for m in range(n_rs, total if EARLY_AG else min(total, n_rs + per)):
        post_ag(m)

    # Reduce-scatter receives land in a rotating scratch buffer, WINDOW messages ahead.
    window = min(WINDOW, n_rs)
    size = seg[0][0].numel()  # segment 0 is the largest
    scratch = workspace(window * size, seg[0][0]).view(window, size) if window else None

    def post_rs(m: int) -> None:
        if m < n_rs:
            _, k, c = where(m)
            recvs[m] = irecv(scratch[m % window][: seg[c][k].numel()], left, group, tag=_RS_TAG)

    for m in range(window):
        post_rs(m)
    sends = []
    for k in range(per):  # the first step's segments are ready now
        step = first
        sends.append(isend(seg[(rank - step - 1) % n][k], right, group,
                           tag=_RS_TAG if step < n - 1 else _AG_TAG))
    for m in range(total):
        step, k, c = where(m)
        wait_all([recvs.pop(m)])
        if m < n_rs:
            combine(op, seg[c][k], scratch[m % window][: seg[c][k].numel()])
            post_rs(m + window)  # its scratch slot is free again
        if not EARLY_AG:
            post_ag(m + per)
        if m + per < total:  # what just arrived goes out as the next step's segment
            sends.append(isend(seg[c][k], right, group, tag=_RS_TAG if step + 1 < n - 1 else _AG_TAG))
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
