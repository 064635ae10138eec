"""Exercise: a ring all-reduce from point-to-point messages (docs/exercises.md).

Write ``allreduce`` below, then grade it -- equal to one process under data parallel and ZeRO, and timed beside
distlab's own rings and torch's:

    distlab verify --nproc 3 --collective examples/exercises/ring_allreduce.py:allreduce
    distlab bench collectives --world 2,4 --algorithms native,ring_plain,examples/exercises/ring_allreduce.py:allreduce
"""

import torch

from distlab.comm.ops import combine
from distlab.comm.p2p import exchange


def allreduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    """Reduce ``buf`` (flat, contiguous, the same size on every rank) over the group's ``n`` ranks, in place.

    1. Cut it into ``n`` chunks: ``chunks = list(torch.tensor_split(buf, n))``.
    2. Reduce-scatter: ``n - 1`` steps; in each, send one chunk to the right neighbour while receiving another
       from the left, and ``combine(op, mine, received)`` it in. Choose the chunks so that after the last step
       rank ``r`` holds the whole reduction of chunk ``r``.
    3. All-gather: ``n - 1`` more steps passing the finished chunks on.
    Send with ``exchange(send, dst, recv, src, group)`` (both in flight at once; its bytes are counted)."""
    raise NotImplementedError("write the ring: a reduce-scatter, then an all-gather (see the docstring)")
