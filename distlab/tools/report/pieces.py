"""What every section of the report is built from: plots as embedded PNGs (:func:`png`, also written to
files on request), tables of numbers with their units (:class:`Col`, :func:`html_table`), formats, and
the labels of runs and layouts."""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from distlab.errors import human_bytes
from distlab.tools.plots import pyplot

_images: list[Path] = []  # render(images=DIR) also writes each plot there: [DIR, written files...]


def png(fig) -> str:
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    if _images:
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        slug = "".join(c if c.isalnum() else "-" for c in (titles[0] if titles else "plot").lower()).strip("-")
        path = _images[0] / f"{len(_images):02d}-{slug[:40]}.png"
        path.write_bytes(buf.getvalue())
        _images.append(path)
    alt = alt_text(fig)
    plt.close(fig)
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def alt_text(fig) -> str:
    """What a figure shows, for a reader who cannot see it: each plot's title and what it draws against
    what; panels without axes labels (a grid of small images) counted, not read out."""
    labelled = [ax for ax in fig.axes if ax.get_xlabel() or ax.get_ylabel()]
    main = labelled or [ax for ax in fig.axes if ax.get_title()]
    parts = [ax.get_title() + (f" ({ax.get_ylabel()} against {ax.get_xlabel()})" if ax.get_xlabel() and ax.get_ylabel()
                               else "") for ax in main]
    rest = len([ax for ax in fig.axes if ax not in main and ax.has_data()])
    text = "; ".join(p for p in parts if p) or "a plot"
    return text + (f"; with {rest} smaller panels" if rest else "")


def _auto(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:80]
    return str(v)


def fmt_ms(seconds) -> str:
    return f"{1000 * seconds:.3g}" if seconds < 0.1 else f"{1000 * seconds:,.0f}"


def fmt_size(nbytes) -> str:
    return human_bytes(nbytes)


def fmt_pct(fraction) -> str:
    return f"{100 * fraction:.2f}%"


def fmt_loss(v) -> str:
    return f"{v:.4f}"  # one fixed format: a loss of 4e-07 beside 0 reads 0.0000, not 4.192e-07


def fmt_sci(v) -> str:
    return f"{v:.1e}"


def fmt_date(text) -> str:
    return str(text)[:10]


@dataclass(frozen=True)
class Col:
    """A table column: the record's field, the header a reader sees (with the unit), the format."""
    key: str
    header: str
    fmt: Callable = _auto

    def cell(self, row: dict) -> str:
        v = row.get(self.key)
        if v is None:
            return "-"
        try:
            return html.escape(self.fmt(v))
        except (TypeError, ValueError):
            return html.escape(str(v))


def html_table(rows: list[dict], columns: list[Col]) -> str:
    head = "".join(f"<th>{html.escape(c.header)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{c.cell(r)}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<div class='table'><table><tr>{head}</tr>{body}</table></div>"


def strategy_label(strategy: dict, world_size: int | None = None) -> str:
    """``bucketed:ring+accum=4+zero=2`` (the Strategy text form) from a summary's strategy object; given
    the run's world size, its label (:meth:`~distlab.parallel.Strategy.label`: ``single process``, no
    method where nothing is synchronised)."""
    from distlab.errors import ConfigError
    from distlab.parallel import Strategy
    try:
        st = Strategy.from_dict(strategy).check()
    except (ConfigError, TypeError):
        return strategy.get("dp_sync", "?")
    return st.label(world_size) if isinstance(world_size, int) and world_size >= 1 else str(st)


def run_label(run: dict) -> str:
    s = run["summary"] or {}
    name = Path(run["path"]).name
    if not s:
        return name
    layout = "one process" if s["world_size"] == 1 else \
        f"x{s['world_size']} {strategy_label(s.get('strategy') or {}, s['world_size'])}"
    return f"{name} ({layout})"


def place_legend(ax, n: int) -> None:
    """Beside the plot, so many runs do not hide the curves."""
    if n:
        ax.legend(fontsize=6 if n > 8 else 7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def bar_chart(labels: list[str], values: list[float], ylabel: str, title: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(labels)), 3.6))
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, rotation=25, ha="right", fontsize=7)
    ax.set(ylabel=ylabel, title=title)
    return png(fig)


def short_path(path: str) -> str:
    """The last two parts of a path: enough to tell runs apart in a table."""
    return "/".join(Path(path).parts[-2:])

def write_images_to(directory: Path) -> None:
    """From now on :func:`png` also writes each plot as a PNG file in ``directory``."""
    _images[:] = [directory]


def stop_writing_images() -> list[Path]:
    """Stop writing plots to files; returns the files written."""
    written = _images[1:]
    _images.clear()
    return written
