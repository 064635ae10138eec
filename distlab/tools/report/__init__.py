"""``distlab report PATH... -o report.html``: one self-contained HTML page from runs and bench JSON.

Inputs, in any mix: run directories (``summary.json`` and/or ``metrics.jsonl``, as ``distlab train
--out`` writes them), bench files (``collectives.json``, ``dp.json``, ``syncbn.json``,
``parallel.json``, ``scaling.json``), ``distlab verify --json`` and ``distlab plan --sweep|--search|validate
--json`` files, and directories holding any of these (searched a few levels deep). The page has, for what the inputs contain:

* training runs, one section per data set and task (a language model's nats/token never share an
  axis with a classifier's loss): loss vs step and vs wall time, test accuracy, a table, and --
  where runs of one strategy span several world sizes -- samples/s and scaling efficiency vs world
  size; for a classifier, the final model's confusion matrix and misclassified test images (the
  run's ``predictions.npz``); for a mixture of experts, each expert's share of the routed tokens;
* collectives: time and bus bandwidth vs message size per algorithm and world size;
* data parallel, SyncBN, tensor parallel / ZeRO: time, memory per rank and bytes per step;
* scaling: efficiency vs workers and loss vs time;
* a plan's search of a GPU cluster: where each ranked layout's step goes, its memory against the GPU's, and why the
  first wins;
* under every plot, the table of the numbers behind it; machine, torch version and date per input.

Plots are PNGs embedded as base64, so the file stands alone. Tables show numbers with their units
(ms, MiB, %). An input named on the command line that is missing, unreadable or not something
distlab wrote is listed at the top of the page (and on stderr); JSON files met while searching a
directory that distlab did not write as run, bench, verify or plan output (snapshot ``meta.json``,
a calibration) are skipped quietly and counted. Nothing stops the report.

The package, one idea per module: :mod:`~distlab.tools.report.inputs` (what is read, what is
refused), :mod:`~distlab.tools.report.pieces` (plots, tables and formats every section shares),
:mod:`~distlab.tools.report.runs` (the training runs' sections), :mod:`~distlab.tools.report.benches`
(one section per bench kind); this module lays out the page.
"""

from __future__ import annotations

import html
from pathlib import Path

from distlab.tools.plots import pyplot
from distlab.tools.report.benches import SECTIONS
from distlab.tools.report.inputs import BENCH_KINDS, Inputs, bench_kind, collect
from distlab.tools.report.pieces import Col, html_table, stop_writing_images, write_images_to
from distlab.tools.report.runs import runs_sections
from distlab.tools.report.timelines import timelines_section

def _machine(records: list[dict]) -> str:
    """Where the records were measured, as far as they say ("" when they say nothing)."""
    r = records[0]
    facts = [f"torch {r['torch_version']}" if r.get("torch_version") else None,
             f"host {r.get('host') or r.get('hostname')}" if (r.get("host") or r.get("hostname")) else None,
             f"{r['cores']} cores" if r.get("cores") else None, r.get("date")]
    return ", ".join(f for f in facts if f)


# A 1280-px window shows the whole page: tables wrap their headers and scroll inside themselves
# rather than widen the page.
CSS = """body{font-family:system-ui,sans-serif;margin:1.5em auto;padding:0 1em;max-width:1200px}
.table{overflow-x:auto;max-width:100%}table{border-collapse:collapse;margin:.5em 0 2em;font-size:12px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#f0f0f0;max-width:9em}
td:first-child,th:first-child{text-align:left}img{max-width:100%;height:auto}.problem{color:#a00}
code{background:#f4f4f4;overflow-wrap:anywhere}h2{overflow-wrap:anywhere}"""


def render(inputs: Inputs, title: str = "distlab report") -> str:
    import datetime
    body = []
    if inputs.runs:
        try:
            body.extend(runs_sections(inputs.runs, inputs.problems))
        except Exception as exc:  # noqa: BLE001 - data distlab did not write; the page goes on without it
            inputs.problems += [(r["path"], f"runs could not be drawn: {type(exc).__name__}: {exc}"[:300])
                                for r in inputs.runs]
        try:
            body.append(timelines_section(inputs.runs))
        except Exception as exc:  # noqa: BLE001 - a trace.json distlab did not write
            inputs.problems += [(r["path"], f"timeline could not be drawn: {type(exc).__name__}: {exc}"[:300])
                                for r in inputs.runs if r.get("trace")]
            pyplot().close("all")
    for kind in BENCH_KINDS:
        for path, records in inputs.bench.get(kind, []):
            name, section = SECTIONS[kind]
            try:
                content = section(records)
            except Exception as exc:  # noqa: BLE001 - a file that looks right but lacks fields or holds other values
                inputs.problems.append((path, f"{kind} records lack a field or hold another value: {exc!r}"[:300]))
                pyplot().close("all")
                continue
            machine = _machine(records)
            body.append(f"<h2>{name}: <code>{html.escape(path)}</code></h2>"
                        + (f"<p>{html.escape(machine)}</p>" if machine else "") + content)
    head = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
            f"<p>Generated {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} by "
            f"<code>distlab report</code>.</p><h2>Inputs</h2>",
            html_table([{"input": p, "kind": k} for p, k in inputs.read], [Col("input", "input"), Col("kind", "kind")])
            if inputs.read else "<p>No usable inputs.</p>"]
    if inputs.skipped:
        head.append(f"<p>{len(inputs.skipped)} other JSON file(s) in the directories searched were skipped: not "
                    f"run, bench, verify or plan output (snapshot meta.json, calibrations, ...).</p>")
    if inputs.problems:
        head.append("<h3 class='problem'>Inputs that could not be used</h3><ul>" + "".join(
            f"<li class='problem'><code>{html.escape(p)}</code>: {html.escape(why)}</li>" for p, why in inputs.problems)
            + "</ul>")
    return "\n".join(head + body + ["</body></html>"])


def write_report(paths: list[str], out: str | Path, title: str = "distlab report",
                 images: str | Path | None = None) -> Inputs:
    """Write the page; with ``images``, also every plot as a PNG file in that directory (for a
    README); their paths are in ``inputs.images``."""
    from distlab.errors import ConfigError
    from distlab.train.metrics import atomic_write_text
    if Path(out).is_dir():
        raise ConfigError(f"-o {out} is a directory: give the HTML file to write, e.g. {Path(out) / 'report.html'}")
    if images and Path(images).exists() and not Path(images).is_dir():
        raise ConfigError(f"--images {images} is a file: give a directory for the PNG files")
    inputs = collect(paths)
    if images:
        Path(images).mkdir(parents=True, exist_ok=True)
        write_images_to(Path(images))
    try:
        atomic_write_text(out, render(inputs, title))
    finally:
        inputs.images = stop_writing_images()
    return inputs


__all__ = ["BENCH_KINDS", "Inputs", "bench_kind", "collect", "render", "write_report"]
