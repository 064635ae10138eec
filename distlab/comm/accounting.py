"""Bytes on the wire, per rank.

Every distlab collective counts what this process sends and receives through point-to-point
messages (``record_send`` / ``record_recv`` are called by the p2p wrappers). For torch's native
collectives nothing can be observed, so they add the standard analytic volume of the
bandwidth-optimal algorithm, as NCCL's "bus bandwidth" does: an all-reduce of ``S`` bytes over
``n`` ranks sends ``2 (n-1)/n * S`` bytes from each rank.

The counter is per process (like torch's own allocator statistics), never per rank or group,
and safe to update from a communication thread (the bucketed data-parallel sync uses one).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class CommStats:
    """Counts since the last reset: collective calls, messages and bytes sent/received."""

    calls: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    analytic: bool = False  # True once a native collective's volume was estimated, not counted
    by_collective: dict = field(default_factory=dict)

    def copy(self) -> "CommStats":
        return CommStats(self.calls, self.messages_sent, self.bytes_sent, self.bytes_recv, self.analytic,
                         dict(self.by_collective))

    def minus(self, other: "CommStats") -> "CommStats":
        return CommStats(self.calls - other.calls, self.messages_sent - other.messages_sent,
                         self.bytes_sent - other.bytes_sent, self.bytes_recv - other.bytes_recv,
                         self.analytic or other.analytic,
                         {k: v - other.by_collective.get(k, 0) for k, v in self.by_collective.items()})


_STATS = CommStats()
_LOCK = threading.Lock()


def stats() -> CommStats:
    """A snapshot of this process's counters."""
    return _STATS.copy()


def bytes_sent() -> int:
    """Bytes this process has sent so far (one number: what a training step reads before and after)."""
    return _STATS.bytes_sent


def reset() -> None:
    global _STATS
    _STATS = CommStats()


def record_call(name: str) -> None:
    with _LOCK:  # `+=` is not atomic across threads (the bucketed sync counts from its own thread)
        _STATS.calls += 1
        _STATS.by_collective[name] = _STATS.by_collective.get(name, 0) + 1


def record_send(nbytes: int) -> None:
    with _LOCK:
        _STATS.messages_sent += 1
        _STATS.bytes_sent += nbytes


def record_recv(nbytes: int) -> None:
    with _LOCK:
        _STATS.bytes_recv += nbytes


def record_analytic(sent: int, received: int) -> None:
    with _LOCK:
        _STATS.bytes_sent += sent
        _STATS.bytes_recv += received
        _STATS.analytic = True


@contextlib.contextmanager
def counting() -> Iterator[CommStats]:
    """``with counting() as c: ...`` -- afterwards ``c`` holds what happened inside the block."""
    before = stats()
    result = CommStats()
    try:
        yield result
    finally:
        delta = stats().minus(before)
        result.__dict__.update(delta.__dict__)


def allreduce_bytes_per_rank(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a bandwidth-optimal all-reduce of ``nbytes``: ``2(n-1)/n * S``."""
    if world_size <= 1:
        return 0
    return int(2 * (world_size - 1) * nbytes // world_size)
