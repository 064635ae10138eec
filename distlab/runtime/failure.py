"""What went wrong, in one line: a rendezvous that failed (:func:`explain_init_failure`: which
address, which rank, what to check) and whether an exception is a peer's lost connection
(:func:`is_comm_failure`)."""

from __future__ import annotations

import re

import torch.distributed as dist

from distlab.errors import DistributedError, first_line

from distlab.runtime.launch import LaunchInfo

def first_line_of(exc: BaseException) -> str:
    """An exception's first line without c10d's internal store keys."""
    text = first_line(exc, 10**6)
    return re.sub(r",?\s*keys?:\s.*$", "", text)[:300]


def explain_init_failure(exc: Exception, info: LaunchInfo, timeout_s: float) -> DistributedError:
    msg = first_line_of(exc)
    where = f"{info.master_addr}:{info.master_port}"
    if "EADDRINUSE" in msg or "address already in use" in msg.lower():
        return DistributedError(
            f"port {info.master_port} on {info.master_addr} is already in use; pick a free one with "
            f"--master-port (another job may be running there)"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", msg)
    if joined:
        return DistributedError(
            f"rank 0 waited {timeout_s:g}s at {where} but only {joined.group(1)} of {info.world_size} "
            f"ranks joined: start every rank with the same --master-addr/--master-port and world size, "
            f"or raise --comm-timeout"
        )
    if "timed out" in msg.lower() or "connect" in msg.lower():
        return DistributedError(
            f"rank {info.rank} could not reach rank 0 at {where} within {timeout_s:g}s ({msg}); check "
            f"that rank 0 is running and that {info.master_addr} is reachable from this host"
        )
    return DistributedError(f"rank {info.rank} failed to join the process group at {where}: {msg}")


_COMM_FAILURE_MARKERS = ("gloo", "nccl", "connection reset", "connection closed", "connection refused",
                         "timed out", "timeout", "broken pipe", "socket")


def is_comm_failure(exc: BaseException) -> bool:
    """True if ``exc`` is a collective failing because a peer died, hung or became unreachable."""
    if isinstance(exc, dist.DistError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(marker in text for marker in _COMM_FAILURE_MARKERS)
    return False
