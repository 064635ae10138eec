"""The report's timelines: each traced run (``--trace A:B``, OUT/trace.json) as a per-rank Gantt chart --
compute, communication and pipeline lanes, coloured by kind -- with what the spans say: the share of
communication hidden behind compute, the communication left exposed per step, the slowest rank."""

from __future__ import annotations

import html

from distlab.plan.timeline_analysis import analyze
from distlab.runtime.trace_file import LANES, SCHEDULE
from distlab.tools.plots import pyplot
from distlab.tools.report.pieces import Col, fmt_ms, fmt_pct, html_table, png, run_label

# (what a span's name starts with or holds, its colour, the legend's word); communication lane: one colour
KINDS = (("forward", "#4c72b0", "forward"), ("backward", "#dd8452", "backward"),
         ("optimizer", "#55a868", "optimizer step"), ("data", "#8c8c8c", "data"),
         ("gradient sync", "#e8a0a0", "waiting for communication"), ("finite", "#ccb974", "checks, clipping"),
         ("clip", "#ccb974", "checks, clipping"), ("evaluation", "#64b5cd", "evaluation"),
         ("snapshot", "#937860", "snapshot"), ("wait", "#e8a0a0", "waiting for communication"))
COMMUNICATION, OTHER = ("#8172b3", "communication"), ("#da8bc3", "other")


STAGE = {"F": KINDS[0][1:], "B": KINDS[1][1:], "W": ("#c44e52", "weight gradients (zero bubble)")}
WAIT = ("#d9d9d9", "pipeline waits")


def _kind(span: dict) -> tuple[str, str]:
    if span["cat"] == "communication":
        return COMMUNICATION
    if span["cat"] == "pipeline":
        return WAIT
    words = span["name"].split()
    if words[0] == "stage":  # "stage 1 chunk 0 F mb 2", "stage 0 B mb 3"
        return next((STAGE[w] for w in words if w in STAGE), OTHER)
    if words[-1] in ("forward", "backward"):  # a block's ("blocks.3 forward"): its phase's colour, edged
        return KINDS[0][1:] if words[-1] == "forward" else KINDS[1][1:]
    return next(((c, w) for k, c, w in KINDS if span["name"].startswith(k)), OTHER)


def timelines_section(runs: list[dict]) -> str:
    traced = [r for r in runs if r.get("trace")]
    if not traced:
        return ""
    out = ["<h2>Timelines</h2>", "<p>Each traced run (<code>--trace A:B</code>), every rank on one clock: the "
           "training thread's spans (compute), its collectives from issue to completion (communication) and a "
           "pipeline stage's messages. <em>hidden</em>: the share of communication time during which the same "
           "rank computed; <em>exposed</em>: communication per step with no compute beside it.</p>"]
    for r in traced:
        out.append(f"<h3>{html.escape(run_label(r))}</h3>")
        events = len(r["trace"]["traceEvents"])
        if events > MAX_EVENTS:  # bounded work: a page in seconds, whatever a trace holds
            out.append(f"<p>Not drawn: its trace holds {events:,} events, more than the {MAX_EVENTS:,} a page "
                       f"reads (trace fewer steps, <code>--trace A:A</code>, or open trace.json in Perfetto).</p>")
            continue
        found = analyze(r["trace"])
        ranks = sorted({e["pid"] for e in r["trace"]["traceEvents"] if e.get("ph") == "X"})
        drawn = ranks if len(ranks) <= MAX_RANKS_DRAWN else \
            ranks[:MAX_RANKS_DRAWN // 2] + ranks[-MAX_RANKS_DRAWN // 2:]
        if len(drawn) < len(ranks):
            out.append(f"<p>Drawn: ranks {drawn[0]}-{drawn[len(drawn) // 2 - 1]} and {drawn[len(drawn) // 2]}-"
                       f"{drawn[-1]} of {len(ranks):,}; the table lists the first {MAX_RANKS_LISTED}.</p>")
        out.append(png(gantt(r["trace"], run_label(r), ranks=set(drawn))))
        out.append(html_table(found["ranks"][:MAX_RANKS_LISTED], [
            Col("rank", "rank"), Col("window_s_per_step", "traced time per step (ms)", fmt_ms),
            Col("compute_s_per_step", "compute per step (ms)", fmt_ms),
            Col("communication_s_per_step", "communication per step (ms)", fmt_ms),
            Col("hidden_communication", "hidden", fmt_pct),
            Col("exposed_communication_s_per_step", "exposed per step (ms)", fmt_ms),
            *([Col("pipeline_wait_fraction", "pipeline waits (bubble)", fmt_pct)]
              if found["pipeline_wait_fraction"] is not None else [])]))
        out.append(f"<p>Slowest rank (the one the others wait for: its collectives are exposed least): "
                   f"{found['slowest_rank']}.</p>")
    return "\n".join(out)


MAX_EVENTS = 200_000  # a trace with more is not drawn (the page's work stays bounded)
MAX_RANKS_DRAWN = 16  # a Gantt chart of more ranks draws the first and last eight
MAX_RANKS_LISTED = 64


def gantt(trace: dict, title: str, ranks: set[int] | None = None):
    """``trace``'s spans as a Gantt chart, a row per rank and lane (``ranks``: those ranks only)."""
    plt = pyplot()
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] != SCHEDULE  # around its waits
             and (ranks is None or e["pid"] in ranks)]
    ranks = sorted({e["pid"] for e in spans})
    lanes = [(rank, lane) for rank in ranks for lane in LANES if any(e["pid"] == rank and e["cat"] == lane
                                                                    for e in spans)]
    height = 0.9 + 0.45 * len(lanes)
    fig, ax = plt.subplots(figsize=(12, height))
    for row, (rank, lane) in enumerate(lanes):
        # the longest first: a span nested in another (a wait inside a forward) is drawn on top of it
        mine = sorted((e for e in spans if e["pid"] == rank and e["cat"] == lane), key=lambda e: -e["dur"])
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"], 1.0) / 1e3) for e in mine], (row - 0.4, 0.8),
                       facecolors=[_kind(e)[0] for e in mine], edgecolor="white", linewidth=0.3)
    other = trace.get("otherData", {})
    who = "stage" if other.get("predicted") else "rank"  # a prediction draws a pipeline's stages, a trace its ranks
    ax.set_yticks(range(len(lanes)), [f"{who} {r} {lane}" for r, lane in lanes], fontsize=8)
    ax.invert_yaxis()
    steps = other.get("steps") or [1, 1]
    when = "one step" if other.get("predicted") else \
        f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}"
    ax.set(xlabel="time (ms)", title=f"{title}: {when}")
    seen = dict.fromkeys(_kind(e) for e in spans)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in seen], labels=[w for _, w in seen],
              fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig
