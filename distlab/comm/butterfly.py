"""Butterfly all-reduce: recursive halving then recursive doubling (Rabenseifner 2004), any world size.

With ``p`` the largest power of two <= ``n`` and ``rem = n - p``: first the ``2*rem`` lowest ranks
pair up and each even one folds its whole buffer into its odd partner, leaving ``p`` active ranks
(the odd ones and those beyond ``2*rem``). Among them, ``log2 p`` halving steps exchange half of the
current segment with the partner across bit ``d`` and reduce the kept half (a reduce-scatter),
then ``log2 p`` doubling steps exchange finished segments back (an all-gather). Finally each odd
rank sends the result to its folded even partner. For a power of two each rank sends
``2(p-1)/p * S`` bytes in ``2 log2 p`` steps: the same volume as the ring in far fewer steps, so it
wins when latency dominates (small messages); folding costs an extra ``S`` on ``2*rem`` ranks.
"""

from __future__ import annotations

import torch

from distlab.comm.ops import combine, workspace
from distlab.comm.p2p import exchange, irecv, isend, wait_all


def _layout(n: int) -> tuple[int, int]:
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def _active_rank(rank: int, rem: int) -> int:
    """Rank among the p active ones, or -1 for an even rank folded away."""
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


def _real_rank(v: int, rem: int) -> int:
    return 2 * v + 1 if v < rem else v + rem


def _halving(buf: torch.Tensor, op: str, group, v: int, p: int, rem: int) -> list[tuple[int, int]]:
    """Recursive-halving reduce-scatter among active ranks; returns the segment history (outermost first)."""
    lo, hi = 0, buf.numel()
    history = []
    scratch = workspace(buf.numel() - buf.numel() // 2, buf)
    d = p // 2
    while d >= 1:
        partner = _real_rank(v ^ d, rem)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        tmp = scratch[: keep[1] - keep[0]]
        exchange(buf[give[0]:give[1]], partner, tmp, partner, group)
        combine(op, buf[keep[0]:keep[1]], tmp)
        history.append((lo, hi))
        lo, hi = keep
        d //= 2
    return history


def _segments(numel: int, v: int, p: int) -> list[tuple[int, int]]:
    """The segment history that halving would produce for active rank ``v`` (no communication)."""
    lo, hi, history, d = 0, numel, [], p // 2
    while d >= 1:
        mid = (lo + hi) // 2
        history.append((lo, hi))
        lo, hi = (lo, mid) if v & d == 0 else (mid, hi)
        d //= 2
    return history


def _doubling(buf: torch.Tensor, group, v: int, p: int, rem: int, history: list[tuple[int, int]]) -> None:
    """Recursive-doubling all-gather: undo the halving, exchanging finished segments."""
    d = 1
    for lo, hi in reversed(history):
        partner = _real_rank(v ^ d, rem)
        mid = (lo + hi) // 2
        mine, theirs = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        exchange(buf[mine[0]:mine[1]], partner, buf[theirs[0]:theirs[1]], partner, group)
        d *= 2


def all_reduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    p, rem = _layout(n)
    v = _active_rank(rank, rem)
    if rank < 2 * rem:  # fold
        if v < 0:
            wait_all([isend(buf, rank + 1, group)])
        else:
            tmp = workspace(buf.numel(), buf)
            wait_all([irecv(tmp, rank - 1, group)])
            combine(op, buf, tmp)
    if v >= 0:
        _doubling(buf, group, v, p, rem, _halving(buf, op, group, v, p, rem))
    if rank < 2 * rem:  # unfold
        wait_all([isend(buf, rank - 1, group)] if v >= 0 else [irecv(buf, rank + 1, group)])


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    """Power of two: recursive halving alone (rank r ends with chunk r). Otherwise the fold breaks
    that mapping, so it is a full butterfly all-reduce and a slice (more bytes; documented)."""
    work = inp.clone()
    p, rem = _layout(n)
    if rem == 0:
        _halving(work, op, group, rank, p, 0)
    else:
        all_reduce(work, op, group, rank, n)
    out.copy_(work.chunk(n)[rank] if work.numel() else work)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, rank: int, n: int) -> None:
    """Power of two: recursive doubling alone. Otherwise a butterfly all-reduce (sum) of disjoint
    placements, exact because every other entry adds zero."""
    out.zero_()
    if out.numel():
        out.chunk(n)[rank].copy_(inp)
    p, rem = _layout(n)
    if rem == 0:
        _doubling(out, group, rank, p, 0, _segments(out.numel(), rank, p))
    else:
        all_reduce(out, "sum", group, rank, n)


def broadcast(buf: torch.Tensor, src: int, group, rank: int, n: int) -> None:
    """Binomial tree from ``src``: ``ceil(log2 n)`` rounds, each doubling the ranks that have it."""
    rel = (rank - src) % n
    mask = 1
    while mask < n:  # receive once, from the rank that differs in our lowest set bit
        if rel & mask:
            wait_all([irecv(buf, (rank - mask) % n, group)])
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if rel + mask < n:
            sends.append(isend(buf, (rank + mask) % n, group))
        mask >>= 1
    wait_all(sends)
