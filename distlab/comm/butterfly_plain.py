"""Recursive halving, then recursive doubling, as the algorithm reads (Rabenseifner 2004), nothing else. Among a
power of two of ranks, each halving step exchanges half of the rank's current segment with the partner across one
bit and keeps the other half, reduced with the partner's copy of it; after ``log2 p`` steps a rank holds one
``1/p`` of the sum, and ``log2 p`` doubling steps send the finished halves back the way they came. Beyond a power
of two, each of the first ``rem`` even ranks folds its whole buffer into the odd rank after it first and gets the
result back last. ``--collective butterfly_plain``; :mod:`distlab.comm.butterfly` is the same exchanges with
every receive posted before the first send, and ``tests/test_comm.py`` holds the two to each other bit for bit.
Its reduce-scatter, all-gather and broadcast are made from the all-reduce (as a user's own collective's are)."""

from __future__ import annotations

import torch

from distlab.comm.ops import combine, finish
from distlab.comm.p2p import exchange, irecv, isend, wait_all


def all_reduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    folded = rank < 2 * rem
    if folded and rank % 2 == 0:  # fold: give everything to the odd rank after it, wait for the result
        wait_all([isend(buf, rank + 1, group)])
        wait_all([irecv(buf, rank + 1, group)])
        finish(op, buf, n)
        return
    if folded:
        theirs = torch.empty_like(buf)
        wait_all([irecv(theirs, rank - 1, group)])
        combine(op, buf, theirs)
    v = rank // 2 if folded else rank - rem  # this rank among the p active ones
    real = lambda u: 2 * u + 1 if u < rem else u + rem  # noqa: E731 - an active rank's real rank
    lo, hi, d, steps = 0, buf.numel(), p // 2, []
    while d >= 1:  # halving: a reduce-scatter among the active ranks
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        partner, got = real(v ^ d), torch.empty(keep[1] - keep[0], dtype=buf.dtype, device=buf.device)
        exchange(buf[give[0]:give[1]], partner, got, partner, group)
        combine(op, buf[keep[0]:keep[1]], got)
        steps.append((partner, keep, give))
        (lo, hi), d = keep, d // 2
    for partner, keep, give in reversed(steps):  # doubling: the finished halves back, an all-gather
        exchange(buf[keep[0]:keep[1]], partner, buf[give[0]:give[1]], partner, group)
    if folded:
        wait_all([isend(buf, rank - 1, group)])
    finish(op, buf, n)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: str, group, rank: int, n: int,
                   scratch: bool = False) -> None:
    work = inp if scratch else inp.clone()
    all_reduce(work, op, group, rank, n)
    out.copy_(work.view(n, -1)[rank] if work.numel() else work)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, rank: int, n: int) -> None:
    out.zero_()
    out.view(n, -1)[rank].copy_(inp.view(-1))
    all_reduce(out, "sum", group, rank, n)


def broadcast(buf: torch.Tensor, src: int, group, rank: int, n: int) -> None:
    if rank != src:
        buf.zero_()
    all_reduce(buf, "sum", group, rank, n)
