"""A solution of examples/exercises/ring_allreduce.py (distlab/comm/ring_plain.py is the same ring)."""

import torch

from distlab.comm.ops import combine
from distlab.comm.p2p import exchange


def allreduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
    chunks = list(torch.tensor_split(buf, n))
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # reduce-scatter: what arrives at step s leaves at step s + 1
        send, recv = (rank - step - 1) % n, (rank - step - 2) % n
        got = incoming[:chunks[recv].numel()]
        exchange(chunks[send], right, got, left, group)
        combine(op, chunks[recv], got)
    for step in range(n - 1):  # all-gather: rank r starts with chunk r whole
        exchange(chunks[(rank - step) % n], right, chunks[(rank - step - 1) % n], left, group)
