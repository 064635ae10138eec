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

:func:`chrome_trace` turns every rank's spans into Chrome's Trace Event Format (one process per
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

LANES = ("compute", "communication", "pipeline")  # a trace's tracks, in this order


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


def tracks(intervals: list[tuple[int, int]]) -> list[int]:
    """A track for each ``(start, end)`` of one lane such that on every track two spans nest or are
    disjoint -- the Trace Event Format's rule for a thread's complete (``X``) events, which viewers
    such as Perfetto drop spans for breaking. Track 0 takes every span it can (a forward and the
    block forwards inside it, a schedule around its waits); a span that partly overlaps one already
    there -- a bucket's reduce-scatter still in flight when the next is issued -- goes to the first
    track it fits, a new one if none does."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    stacks: list[list[int]] = []  # per track, the ends of the spans still open at the current start
    out = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        for k, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or stack[-1] >= end:
                stack.append(end)
                out[i] = k
                break
        else:
            stacks.append([end])
            out[i] = len(stacks) - 1
    return out


def chrome_trace(ranks: list[dict]) -> dict:
    """Chrome's Trace Event Format of every rank's spans; ``ranks``: per rank ``{"rank", "offset_ns",
    "spans"}`` (:meth:`Recorder.spans`, stamped on that rank's clock). A process per rank, a thread per
    lane (``tid`` the lane's index) and, where a lane's spans overlap without nesting (collectives in
    flight at once), further threads for it (:func:`tracks`; ``tid`` the lane's index plus a multiple
    of the number of lanes, named "communication 2", ...). Times are whole nanoseconds written in
    microseconds, so a reader's ``ts + dur`` is exact and nesting survives the conversion."""
    starts = [s[2] + r["offset_ns"] for r in ranks for s in r["spans"]]
    origin = min(starts) if starts else 0
    events = []
    for r in ranks:
        pid = r["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for index, lane in enumerate(LANES):
            mine = [s for s in r["spans"] if s[1] == lane]
            spans = [(int(t0 + r["offset_ns"] - origin), int(max(t1, t0) + r["offset_ns"] - origin))
                     for _, _, t0, t1, _ in mine]
            track = tracks(spans)
            for k in range(max(track, default=0) + 1):
                tid = index + k * len(LANES)
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": lane if k == 0 else f"{lane} {k + 1}"}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": index * 1000 + k}})
            for (name, _, _, _, args), (a, b), k in zip(mine, spans, track):
                events.append({"ph": "X", "name": name, "cat": lane, "pid": pid, "tid": index + k * len(LANES),
                               "ts": a / 1e3, "dur": (b - a) / 1e3, **({"args": args} if args else {})})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def predicted_trace(spans: list[dict], label: str = "predicted") -> dict:
    """``distlab plan``'s predicted step (its ``timeline``: rank -- a pipeline's stage, else 0 --, name,
    lane, start_s, end_s) in the same Chrome trace format as a measured one: a process per stage, the
    same lanes."""
    ranks = sorted({s.get("rank", 0) for s in spans})
    trace = chrome_trace([{"rank": r, "offset_ns": 0, "spans": [
        (s["name"], s["lane"], int(s["start_s"] * 1e9), int(s["end_s"] * 1e9),
         {"blocking": True} if s["lane"] == "communication" and s["name"].startswith(("all-gather (", "tensor/"))
         else {}) for s in spans if s.get("rank", 0) == r]} for r in ranks])
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "process_name":
            e["args"]["name"] = label if len(ranks) == 1 else f"{label}, stage {e['pid']}"
    trace["otherData"] = {"steps": [1, 1], "clock": "predicted by distlab plan", "predicted": True}
    return trace


# ---------------------------------------------------------------------------- reading a trace

WAITS = ("gradient sync",)  # compute-lane spans that mostly wait for communication: not compute (nor "wait ...")
SCHEDULE = "pipeline schedule"  # a stage's whole schedule in a step, on the pipeline lane around its waits


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two unions (each sorted and disjoint), sorted and disjoint."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _minus(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``x`` without ``y`` (unions, sorted and disjoint)."""
    out = []
    for a, b in x:
        for c, d in y:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def analyze(trace: dict) -> dict:
    """What a trace says, per rank and overall (times in seconds): the window each rank was traced
    (first span to last) per step, its compute (compute-lane spans, less the time they waited: the
    sync's, ``wait ...`` spans and collectives that blocked the training thread), its
    communication (the communication lane's union), the share of that communication hidden behind
    its compute, the communication left exposed per step, and the slowest rank (the one the others
    wait for); for a pipeline, each stage's waits for its neighbours over the time its
    schedule ran (``bench pipeline``'s measured bubble)."""
    steps = trace.get("otherData", {}).get("steps") or [1, 1]
    n = max(1, steps[1] - steps[0] + 1)
    by_rank: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            by_rank.setdefault(e["pid"], []).append(e)
    ranks = []
    for rank, events in sorted(by_rank.items()):
        def lane(name, keep=lambda e: True):
            return _union([(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
                           if e["cat"] == name and keep(e)])
        waiting = _union(lane("compute", lambda e: e["name"] in WAITS or e["name"].startswith("wait"))
                         + lane("communication", lambda e: (e.get("args") or {}).get("blocking")))
        compute = _minus(lane("compute", lambda e: e["name"] not in WAITS and not e["name"].startswith("wait")),
                         waiting)  # a forward that waits for ZeRO-3's gathers computes only around them
        comm = lane("communication")
        waits = lane("pipeline", lambda e: e["name"] != SCHEDULE)
        schedule = _length(lane("pipeline", lambda e: e["name"] == SCHEDULE))
        window = max(e["ts"] + e["dur"] for e in events) / 1e6 - min(e["ts"] for e in events) / 1e6
        hidden = _length(_intersect(comm, compute))
        ranks.append({"rank": rank, "window_s_per_step": window / n, "compute_s_per_step": _length(compute) / n,
                      "communication_s_per_step": _length(comm) / n,
                      "hidden_communication": hidden / _length(comm) if comm else None,
                      "exposed_communication_s_per_step": (_length(comm) - hidden) / n,
                      # a stage's waits for its neighbours over its schedule's time (bench pipeline's bubble)
                      **({"pipeline_wait_fraction": _length(waits) / schedule} if schedule else {})})
    comm_total = sum(r["communication_s_per_step"] for r in ranks)
    hidden_total = sum((r["hidden_communication"] or 0.0) * r["communication_s_per_step"] for r in ranks)
    bubbles = [r["pipeline_wait_fraction"] for r in ranks if "pipeline_wait_fraction" in r]
    return {"steps": n, "ranks": ranks, "pipeline_wait_fraction": sum(bubbles) / len(bubbles) if bubbles else None,
            "hidden_communication": hidden_total / comm_total if comm_total else None,
            "exposed_communication_s_per_step": max((r["exposed_communication_s_per_step"] for r in ranks), default=0.0),
            "slowest_rank": _slowest(ranks)}


def _slowest(ranks: list[dict]) -> int | None:
    """The rank the others wait for: it reaches each collective last, so its own communication is
    exposed least; without communication, the one computing most."""
    if not ranks:
        return None
    if any(r["communication_s_per_step"] for r in ranks):
        return min(ranks, key=lambda r: r["exposed_communication_s_per_step"])["rank"]
    return max(ranks, key=lambda r: r["compute_s_per_step"])["rank"]


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
