"""What a recording becomes: every rank's spans as one Chrome trace (Trace Event Format: a process per
rank, a thread per lane and, where a lane's spans overlap without nesting, more threads for it), and
``distlab plan``'s predicted step in the same format. (:mod:`~distlab.runtime.timeline` records the
spans; :mod:`distlab.plan.timeline_analysis` reads what a trace says.)"""

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


SCHEDULE = "pipeline schedule"  # a stage's whole schedule in a step, on the pipeline lane around its waits
