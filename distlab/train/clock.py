"""Per-step times that never make the host wait for the device.

On a CPU a step's time is the host clock's. On a GPU the host only queues a step's kernels and runs
ahead; reading a host clock after ``torch.cuda.synchronize`` would time the step but stall the queue
every step (the next step's launches wait for this one's last kernel), a cost the plain loop does not
pay. So :class:`StepClock` records a CUDA event on the stream as each step starts, and a step's time is
the gap between its start event and the next one as the device saw them -- its kernels and any time
the device sat idle waiting for the host: the step's true share of the run. The events are read in one
go when the trainer waits for the device anyway (:meth:`StepClock.flush`: before a log line, an
evaluation or a snapshot).
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """``start()`` as a step begins, ``stop(times, ...)`` as it ends; on a GPU ``flush(times)`` adds the
    steps stopped since the last flush (one wait for the device). ``times``: a
    :class:`~distlab.train.summary.StepTimes`; returns the seconds added."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        self._event: torch.cuda.Event | None = None
        self._pending: list[tuple[torch.cuda.Event, float, int]] = []  # (start event, sync seconds, bytes)

    def start(self) -> None:
        if self.cuda:
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self, times, sync_s: float, sent: int) -> float:
        """The step's seconds where they are known now (a CPU), else 0 until :meth:`flush`."""
        if self.cuda:
            self._pending.append((self._event, sync_s, sent))
            return 0.0
        step_s = time.perf_counter() - self._t0
        times.add(step_s, sync_s, sent)
        return step_s

    def flush(self, times) -> float:
        """Add every step stopped since the last flush to ``times`` (waits for the last one to finish);
        returns their seconds together."""
        if not self._pending:
            return 0.0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        starts = [p[0] for p in self._pending] + [end]
        total = 0.0
        for (event, sync_s, sent), following in zip(self._pending, starts[1:]):
            step_s = event.elapsed_time(following) / 1e3
            times.add(step_s, sync_s, sent)
            total += step_s
        self._pending.clear()
        return total
