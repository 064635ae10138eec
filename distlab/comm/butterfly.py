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

from distlab.comm import p2p
from distlab.comm.ops import combine, combiner, finish, workspace
from distlab.comm.p2p import irecv, isend, wait_all


_HALVE_TAG, _DOUBLE_TAG = 0, 1


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


def _plan(numel: int, v: int, p: int, rem: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """The halving steps of active rank ``v``, outermost first: (partner's real rank, kept range,
    given range). Doubling replays them in reverse, sending the kept range and receiving the given."""
    lo, hi, d, steps = 0, numel, p // 2, []
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        steps.append((_real_rank(v ^ d, rem), keep, give))
        lo, hi = keep
        d //= 2
    return steps


def _butterfly(buf: torch.Tensor, op: str | None, group, v: int, p: int, rem: int,
               halve: bool = True, double: bool = True) -> None:
    """Recursive halving (reduce-scatter) and/or doubling (all-gather) on ``buf`` among the active ranks.

    Every receive is posted before the first send: gloo moves a message only once its receive is
    posted, and a late one costs a round trip of notices per step. Halving receives land in a
    scratch buffer (sizes S/2, S/4, ...: S in all); doubling receives land straight in ``buf``.
    That is safe although ``buf`` is still being sent from: a partner's doubling message for a
    range exists only after that partner has received our halving message from the same range.
    Each partner's connection is resolved once (:class:`~distlab.comm.p2p.Peer`): at 1e3 elements
    the time is all per-message latency, and the Python around each message is part of it.
    """
    steps = _plan(buf.numel(), v, p, rem)
    peers = [p2p.Peer(group, partner) for partner, _, _ in steps]  # connection and tags, once
    recv_h, recv_d, scratch = [], [], []
    if halve:
        ws = workspace(sum(k[1] - k[0] for _, k, _ in steps), buf)
        offset = 0
        for (_, (k0, k1), _), peer in zip(steps, peers):
            scratch.append(ws[offset:offset + k1 - k0])
            offset += k1 - k0
            recv_h.append(peer.irecv(scratch[-1], _HALVE_TAG))
    if double:
        recv_d = [peer.irecv(buf[g0:g1], _DOUBLE_TAG) for (_, _, (g0, g1)), peer in zip(steps, peers)]
    sends = []
    if halve:
        reduce = combiner(op)
        for (_, (k0, k1), (g0, g1)), peer, work, tmp in zip(steps, peers, recv_h, scratch):
            sends.append(peer.isend(buf[g0:g1], _HALVE_TAG))
            wait_all([work])
            reduce(buf[k0:k1], tmp)
    if double:
        for (_, (k0, k1), _), peer, work in zip(reversed(steps), reversed(peers), reversed(recv_d)):
            sends.append(peer.isend(buf[k0:k1], _DOUBLE_TAG))
            wait_all([work])
    wait_all(sends)


def all_reduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    _all_reduce(buf, op, group, rank, n)
    finish(op, buf, n)


def _all_reduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
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
        _butterfly(buf, op, group, v, p, rem)
    if rank < 2 * rem:  # unfold
        wait_all([isend(buf, rank - 1, group)] if v >= 0 else [irecv(buf, rank + 1, group)])


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: str, group, rank: int, n: int,
                   scratch: bool = False) -> None:
    """Power of two: recursive halving alone (rank r ends with chunk r). Otherwise the fold breaks
    that mapping, so it is a full butterfly all-reduce and a slice (more bytes; documented)."""
    work = inp if scratch else inp.clone()
    p, rem = _layout(n)
    if rem == 0:
        _butterfly(work, op, group, rank, p, 0, double=False)
    else:
        _all_reduce(work, op, group, rank, n)
    out.copy_(work.chunk(n)[rank] if work.numel() else work)
    finish(op, out, n)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, rank: int, n: int) -> None:
    """Power of two: recursive doubling alone. Otherwise a butterfly all-reduce (sum) of disjoint
    placements, exact because every other entry adds zero."""
    out.zero_()
    if out.numel():
        out.chunk(n)[rank].copy_(inp)
    p, rem = _layout(n)
    if rem == 0:
        _butterfly(out, None, group, rank, p, 0, halve=False)
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
