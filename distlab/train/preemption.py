"""Preemption: SIGTERM makes every rank stop at the same step boundary, snapshot and exit 0.

Slurm (``scancel``, a job's time limit, a higher-priority job) and Kubernetes (an evicted pod)
send SIGTERM and, some seconds later, SIGKILL. torchrun's agent passes SIGTERM on to its workers
and waits for them (30 s by default) before killing them. The signal reaches each rank at a
different moment -- mid-backward on one, between steps on another -- so no rank may stop on its
own: its peers would wait in the next collective until the timeout.

Instead the handler only sets a flag. At the end of every step each rank starts an asynchronous
all-reduce (MAX) of its flag and, at the end of the next step, reads the result of the one before:
every rank reads the same value for the same step, so all stop at the same boundary -- at most two
steps after the first rank saw the signal -- and the per-step cost is one 4-byte collective that
overlaps a whole step. The loop then snapshots (``--resume auto`` continues bitwise) and writes its
summary with ``"stopped": "preempted"``.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist


class Preemption:
    """Context: SIGTERM sets a flag; :meth:`poll` (collective, once per step) says when every rank stops."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.signalled = False  # this rank received SIGTERM
        self._previous = None
        self._pending: tuple | None = None  # (work, flag tensor) of the last poll's all-reduce

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._pending is not None and exc[0] is None:
            self._pending[0].wait()  # never leave a collective half done
        self._pending = None

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def poll(self) -> bool:
        """Whether some rank had been signalled by the previous call (every rank gets the same answer)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.signalled
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            if flag.item():
                return True  # on every rank: none starts another all-reduce
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int32, device=self.device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return False
