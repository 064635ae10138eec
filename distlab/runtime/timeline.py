"""Per-rank timelines: when each rank computes, communicates and waits, as spans on one clock.

A :class:`Recorder` is on only between :func:`start` and :func:`stop` (``--trace A:B``: optimizer
steps A to B). While it is off, :func:`span` returns one shared do-nothing context and
:func:`async_span` returns at once: the traced code pays an attribute read.

* :func:`span` -- ``with timeline.span("backward"):`` -- times a block of this thread;
* :func:`async_span` -- a collective from its issue to its completion, whichever thread completes
  it (torch's work future, distlab's communication thread): an all-reduce that overlaps the
  backward shows as such.

Spans carry a **lane** -- ``compute`` (the training thread: data, forward, backward, optimizer),
``communication`` (collectives, synchronous or in flight) and ``pipeline`` (a stage's sends,
receives and waits) -- one track each in the written trace.

**One clock for all ranks.** Each rank stamps with its monotonic clock (``time.perf_counter_ns``),
which every process of one machine shares: ranks on rank 0's machine need no correction. A rank on
another machine estimates its offset from rank 0's once, from the moments several barriers release
every rank (median of the rounds); the spread of those estimates is the residual the trace states.

:func:`~distlab.runtime.trace_file.chrome_trace` turns every rank's spans into Chrome's Trace Event Format (one process per
rank, one thread per lane; ``ts``/``dur`` in microseconds), which Perfetto and chrome://tracing open.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time

import torch
import torch.distributed as dist


class Recorder:
    """Spans of one rank: ``(name, lane, start_ns, end_ns, args)``, appended from any thread.

    On a CUDA device the training thread's spans are CUDA events on the current stream (when the GPU
    ran the work, not when the host queued it), read once at :meth:`finish` -- no synchronisation
    inside the traced steps -- and placed on the host clock from the moment the first event was
    queued; collectives' spans stay host-timed."""

    def __init__(self, rank: int, device: torch.device | None = None):
        self.rank = rank
        self.spans: list[tuple[str, str, int, int, dict]] = []
        self._lock = threading.Lock()
        self.cuda = device is not None and device.type == "cuda"
        self._events: list[tuple[str, str, object, object, dict]] = []
        if self.cuda:
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record()
            self._base_ns = time.perf_counter_ns()

    def add(self, name: str, lane: str, start: int, end: int, args: dict | None = None) -> None:
        with self._lock:
            self.spans.append((name, lane, start, end, args or {}))

    def finish(self) -> None:
        """Turn the CUDA events into stamps (one synchronisation, after the traced steps)."""
        if not self._events:
            return
        torch.cuda.synchronize()
        for name, lane, start, end, args in self._events:
            self.add(name, lane, self._base_ns + int(self._base.elapsed_time(start) * 1e6),
                     self._base_ns + int(self._base.elapsed_time(end) * 1e6), args)
        self._events = []


_ACTIVE: Recorder | None = None
_OFF = contextlib.nullcontext()
_BLOCK: str | None = None  # the block the training thread is in (trace_blocks), for its collectives' spans
_LABELS = False  # torch.profiler is on (--profile): every span is also a record_function range in its trace


def label_for_profiler(on: bool) -> None:
    """While ``on``, spans also mark torch.profiler's trace (``record_function``), recorder or not."""
    global _LABELS
    _LABELS = on


def start(rank: int, device: torch.device | None = None) -> Recorder:
    """Record this rank's spans from now (a recorder already on keeps its spans); on a CUDA ``device``
    the training thread's spans by CUDA events."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = Recorder(rank, device)
    return _ACTIVE


def stop() -> Recorder | None:
    """Stop recording; the recorder with its spans (None: none was on)."""
    global _ACTIVE, _BLOCK
    rec, _ACTIVE, _BLOCK = _ACTIVE, None, None
    if rec is not None:
        rec.finish()
    return rec


def active() -> bool:
    return _ACTIVE is not None


@contextlib.contextmanager
def _timed(rec: Recorder, name: str, lane: str, args: dict):
    if rec.cuda and lane != "communication" and threading.current_thread() is threading.main_thread():
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            with rec._lock:
                rec._events.append((name, lane, start, end, args))
        return
    t0 = time.perf_counter_ns()
    try:
        yield
    finally:
        rec.add(name, lane, t0, time.perf_counter_ns(), args)


def span(name: str, lane: str = "compute", **args):
    """``with span(...):`` times the block on ``lane`` while recording; nothing otherwise. The calling
    thread is busy for the whole span: a collective timed so (on the communication lane) blocked it,
    and a compute-lane span whose name starts with ``wait`` is time it waited."""
    rec = _ACTIVE
    if rec is None:
        return _OFF if not _LABELS else torch.profiler.record_function(name)
    if lane == "communication":  # a collective blocks the calling thread; within a block, it says which
        args = {**args, "blocking": True}
        if _BLOCK is not None and threading.current_thread() is threading.main_thread():
            name, args["block"] = f"{name} in {_BLOCK}", _BLOCK
    timed = _timed(rec, name, lane, args)
    return timed if not _LABELS else _both(torch.profiler.record_function(name), timed)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def async_span(name: str, handle, lane: str = "communication", **args) -> None:
    """A collective under way from now until ``handle`` (a :class:`distlab.comm.Handle`) completes."""
    rec = _ACTIVE
    if rec is None:
        return
    t0 = time.perf_counter_ns()
    handle.on_done(lambda: rec.add(name, lane, t0, time.perf_counter_ns(), args))


def size_text(nbytes: int) -> str:
    """``1.9 MB``, ``12 KB``: a message's size in a span's name."""
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.1f} MB"
    return f"{nbytes / 2**10:.0f} KB" if nbytes >= 2**10 else f"{nbytes} B"


def clock_offset(rounds: int = 5) -> tuple[int, int]:
    """(this rank's offset to add to its stamps to get rank 0's clock, the residual), in ns, both 0 on
    one process. Collective: every rank reads its clock as each of ``rounds`` barriers releases it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0, 0
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, (socket.gethostname(), _boot_id()))
    if hosts[dist.get_rank()] == hosts[0]:  # rank 0's machine: the same monotonic clock, nothing to estimate
        same = all(h == hosts[0] for h in hosts)
        if same:
            return 0, 0
    estimates = []
    for _ in range(rounds):
        dist.barrier()
        now = time.perf_counter_ns()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, now)
        estimates.append(everyone[0] - now)
    if hosts[dist.get_rank()] == hosts[0]:
        return 0, 0
    offset = int(statistics.median(estimates))
    return offset, int(max(estimates) - min(estimates))


def _boot_id() -> str:
    """This boot of this machine (network namespaces of one host share its hostname and its clock)."""
    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------- a model's blocks

def trace_blocks(blocks: list[tuple[str, object, object, list]]) -> list:
    """Spans of each block's forward and backward while recording: ``blocks`` are ``(name, first
    module, last module, its modules)``. Forward: from the first module's input to the last one's
    output; backward: from the moment the gradient of the block's output arrives to the moment its
    input's is done -- or, for a block whose input needs no gradient (the first, fed the data), the
    moment the last of its parameters' gradients is done (tensor hooks, which change nothing). Where a
    block's input is the output of the block before, the two spans meet at one instant (that tensor's
    gradient) instead of overlapping by the time its hooks take. Returns the hook handles
    (``remove()`` each)."""
    handles = []
    handover: list = [None, None]  # (gradient, the block before's start) between its enter and our leave

    for name, first, last, modules in blocks:
        state: dict = {}
        params = [p for m in modules for p in m.parameters(recurse=True) if p.requires_grad]

        def before(module, args, name=name, state=state):
            global _BLOCK
            if _ACTIVE is not None:
                state["t0"] = time.perf_counter_ns()
                state["x"] = args[0] if args and isinstance(args[0], torch.Tensor) else None
                _BLOCK = name
            for h in state.pop("param_hooks", []):  # the last backward's, fired or not
                h.remove()

        def after(module, args, out, name=name, state=state, params=params):
            global _BLOCK
            _BLOCK = None
            rec = _ACTIVE
            if rec is None or "t0" not in state:
                return
            rec.add(f"{name} forward", "compute", state.pop("t0"), time.perf_counter_ns())
            x = state.pop("x", None)
            if not (torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad):
                return
            began: list[int] = []

            def enter(g, name=name):  # the gradient of the block's output arrived: its backward begins
                global _BLOCK
                began[:] = [time.perf_counter_ns()]
                handover[:] = [g, began]  # the block after may end on this same gradient: its end is our start
                _BLOCK = name

            def end(now: int, name=name):
                global _BLOCK
                if _BLOCK == name:  # (the block before may have begun already: its output is this input)
                    _BLOCK = None
                if began:
                    rec.add(f"{name} backward", "compute", began[0], now)
                    began.clear()

            def leave(g):  # its input's gradient is done: its backward ends
                now = time.perf_counter_ns()
                end(now)
                if handover[0] is g:  # the block before began on this gradient: it begins as we end
                    handover[1][:] = [now]
                handover[:] = [None, None]

            out.register_hook(enter)
            if x is not None and x.requires_grad:
                x.register_hook(leave)
            elif params:  # fed the data: its backward ends with its parameters' last gradient
                left = [len(params)]

                def param_done(g, left=left):
                    left[0] -= 1
                    if left[0] == 0:
                        end(time.perf_counter_ns())
                state["param_hooks"] = [p.register_hook(param_done) for p in params]

        handles += [first.register_forward_pre_hook(before), last.register_forward_hook(after)]
        handles.append(_ParamHooks(state))
    return handles


class _ParamHooks:
    """The parameter hooks a block's last traced backward left (removed with the block's other hooks)."""

    def __init__(self, state: dict):
        self.state = state

    def remove(self) -> None:
        for h in self.state.pop("param_hooks", []):
            h.remove()
