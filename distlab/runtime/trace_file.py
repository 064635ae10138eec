"""What a recording becomes and what it says: every rank's spans as one Chrome trace (Trace Event
Format: a process per rank, a thread per lane and, where a lane's spans overlap without nesting, more
threads for it), ``distlab plan``'s predicted step in the same format, and the reading of either --
compute, communication hidden or exposed, a pipeline's bubble, the slowest rank -- that the summary,
the report and ``plan validate`` share. (:mod:`~distlab.runtime.timeline` records the spans.)"""

from __future__ import annotations

LANES = ("compute", "communication", "pipeline")  # a trace's tracks, in this order


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
