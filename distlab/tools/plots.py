"""Matplotlib helpers shared by the bench plots and ``distlab report``.

Runs that compute the same thing draw the same curve (every data-parallel method reaches the same
loss), so each line gets its own dash pattern and marker, with markers at offsets that differ
between lines: identical curves stay visible. Counts (workers, world sizes) get integer ticks.
"""

from __future__ import annotations

LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "x", "P", "*")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def style(i: int, points: int = 0) -> dict:
    """Keyword arguments for ``ax.plot`` of the ``i``-th line of ``points`` points."""
    kw = {"linestyle": LINESTYLES[i % len(LINESTYLES)], "marker": MARKERS[i % len(MARKERS)], "markersize": 4}
    if points > 12:  # a marker every ~10 points, shifted per line so coinciding lines show all of theirs
        every = points // 10
        kw["markevery"] = ((i * max(1, every // 3)) % every, every)
    return kw


def integer_ticks(ax, values, axis: str = "x") -> None:
    """Ticks at exactly ``values`` (worker counts, world sizes): no 1.5 workers."""
    ticks = sorted({int(v) for v in values})
    if ticks:
        (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks, [str(t) for t in ticks])
