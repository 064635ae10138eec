"""What ``distlab bench overhead`` records say, per workload and precision: each side's median step
and distlab / plain per round (median and range), and their bar chart -- shared by the bench's own
table and the HTML report."""

from __future__ import annotations

import statistics


COMPILED_RATIOS = {"compiled_ratio": ("distlab-compiled", "plain-compiled"),  # both compiled: distlab's cost
                   "compile_speedup": ("distlab", "distlab-compiled")}  # what compiling gains distlab's step


def _ratios(by: dict, a: str, b: str) -> list[float]:
    return [by[a][k] / by[b][k] for k in by.get(a, {}) if k in by.get(b, {})]


def summarize(records: list[dict]) -> list[dict]:
    """Per workload x precision: each side's median step (median over rounds) and distlab / plain per
    round -- median and range."""
    rows = []
    for key in dict.fromkeys((r["workload"], r["precision"], r["device"]) for r in records):
        mine = [r for r in records if (r["workload"], r["precision"], r["device"]) == key]
        by = {side: {r["round"]: r["time_per_step_s_median"] for r in mine if r["side"] == side}
              for side in dict.fromkeys(r["side"] for r in mine)}
        ratios = _ratios(by, "distlab", "plain")
        row = {"workload": key[0], "precision": key[1], "device": key[2],
               "rounds": max(len(v) for v in by.values()),
               **{f"{side}_s": statistics.median(v.values()) for side, v in by.items()},
               "ratio_median": statistics.median(ratios) if ratios else None,
               "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None)}
        for name, (a, b) in COMPILED_RATIOS.items():  # with --compile: per round, like the ratio above
            if (got := _ratios(by, a, b)):
                row.update({f"{name}_median": statistics.median(got), f"{name}_min": min(got), f"{name}_max": max(got)})
        rows.append(row)
    return rows


def figure(records: list[dict]):
    """The bar chart of distlab / plain per workload and precision (median, range of the rounds)."""
    from distlab.tools.plots import pyplot
    plt = pyplot()
    # eager distlab / plain where both ran, else both compiled (a run of the compiled sides alone)
    rows = [(r, "ratio" if r["ratio_median"] is not None else "compiled_ratio") for r in summarize(records)
            if r["ratio_median"] is not None or "compiled_ratio_median" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([f"{r['workload']} {r['precision']}{' compiled' if k != 'ratio' else ''}" for r, k in rows],
           [r[f"{k}_median"] for r, k in rows],
           yerr=[[r[f"{k}_median"] - r[f"{k}_min"] for r, k in rows], [r[f"{k}_max"] - r[f"{k}_median"] for r, k in rows]],
           capsize=4)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set(ylabel="distlab / plain loop (median step)", title=f"single-process overhead on {rows[0][0]['device']}")
    return fig
