"""What a trace says -- measured (``--trace``) or predicted (``distlab plan``): compute, communication
hidden or exposed, a pipeline's bubble, the slowest rank; what the summary, the report and ``plan
validate`` share."""

from __future__ import annotations

from distlab.runtime.trace_file import SCHEDULE

WAITS = ("gradient sync",)  # compute-lane spans that mostly wait for communication: not compute (nor "wait ...")


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
