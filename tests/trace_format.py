"""What a viewer (Perfetto, chrome://tracing) requires of a Chrome trace that distlab writes."""

from __future__ import annotations

from distlab.runtime import trace_file


def complete_events(trace: dict) -> list[dict]:
    """The trace's complete (``X``) events, after checking the Trace Event Format: every event a
    phase, an integer process and thread; every complete event a name, a lane (its category) on a
    thread of that lane, named by metadata, a non-negative time and duration; and on every
    (process, thread) two complete events nest or are disjoint, in whole nanoseconds as Perfetto reads
    them (``llround(ts * 1000)``) -- the rule Perfetto drops spans for breaking."""
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms" and events
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = []
    for e in events:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert e["name"] and e["cat"] in trace_file.LANES and e["ts"] >= 0 and e["dur"] >= 0, e
            assert e["tid"] % len(trace_file.LANES) == trace_file.LANES.index(e["cat"]), e
            assert threads.get((e["pid"], e["tid"]), "").startswith(e["cat"]), e
            spans.append(e)
    by_track: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for e in spans:
        a = round(e["ts"] * 1000)
        by_track.setdefault((e["pid"], e["tid"]), []).append((a, a + round(e["dur"] * 1000), e["name"]))
    for track, mine in by_track.items():
        open_: list[tuple[int, int, str]] = []
        for a, b, name in sorted(mine, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1][1] <= a:
                open_.pop()
            assert not open_ or b <= open_[-1][1], \
                f"on {track}, {name!r} [{a}, {b}] ns partly overlaps {open_[-1][2]!r} {open_[-1][:2]}"
            open_.append((a, b, name))
    return spans
