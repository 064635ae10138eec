"""Bytes on the wire.

For torch's native collectives we cannot count bytes, so we use the standard analytic volume of
the bandwidth-optimal (ring) algorithm, as NCCL's "bus bandwidth" does: an all-reduce of ``S``
bytes over ``n`` ranks sends ``2 (n-1)/n * S`` bytes from each rank.
"""

from __future__ import annotations


def allreduce_bytes_per_rank(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a bandwidth-optimal all-reduce of ``nbytes``: ``2(n-1)/n * S``."""
    if world_size <= 1:
        return 0
    return int(2 * (world_size - 1) * nbytes // world_size)
