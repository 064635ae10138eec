"""``distlab report PATH... -o report.html``: one self-contained HTML page from runs and bench JSON.

Inputs, in any mix: run directories (``summary.json`` and/or ``metrics.jsonl``, as ``distlab train
--out`` writes them), bench files (``collectives.json``, ``dp.json``, ``syncbn.json``,
``parallel.json``, ``scaling.json``), ``distlab verify --json`` files, and directories holding any
of these (searched a few levels deep). The page has, for what the inputs contain:

* training runs, one section per data set and task (a language model's nats/token never share an
  axis with a classifier's loss): loss vs step and vs wall time, test accuracy, a table, and --
  where runs of one strategy span several world sizes -- samples/s and scaling efficiency vs world
  size; for a classifier, the final model's confusion matrix and misclassified test images (the
  run's ``predictions.npz``); for a mixture of experts, each expert's share of the routed tokens;
* collectives: time and bus bandwidth vs message size per algorithm and world size;
* data parallel, SyncBN, tensor parallel / ZeRO: time, memory per rank and bytes per step;
* scaling: efficiency vs workers and loss vs time;
* under every plot, the table of the numbers behind it; machine, torch version and date per input.

Plots are PNGs embedded as base64, so the file stands alone. Tables show numbers with their units
(ms, MiB, %). An input named on the command line that is missing, unreadable or not something
distlab wrote is listed at the top of the page (and on stderr); JSON files met while searching a
directory that distlab did not write as run, bench, verify or plan output (snapshot ``meta.json``,
a calibration) are skipped quietly and counted. Nothing stops the report.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from distlab.bench.common import human_bytes
from distlab.tools.plots import integer_ticks, pyplot, style

BENCH_KINDS = ("collectives", "dp", "syncbn", "parallel", "pipeline", "scaling", "verify", "plan", "sweep", "overhead",
               "checkpointing")
BENCH_FILES = {f"{kind}.json" for kind in BENCH_KINDS}  # names the bench commands write: never skipped quietly
PLAN_VALIDATION = "distlab-plan-validation"


@dataclass
class Inputs:
    runs: list[dict] = field(default_factory=list)        # {"path", "summary", "metrics"}
    bench: dict[str, list[tuple[str, list[dict]]]] = field(default_factory=dict)  # kind -> [(path, records)]
    problems: list[tuple[str, str]] = field(default_factory=list)                # (path, what is wrong)
    read: list[tuple[str, str]] = field(default_factory=list)                    # (path, kind)
    images: list[Path] = field(default_factory=list)                             # PNGs written (--images)
    skipped: list[str] = field(default_factory=list)    # JSON found in a directory that distlab did not write


# --------------------------------------------------------------------------- reading


_KINDS = [  # a bench's JSON by the fields of its first record, in this order
    ("collectives", ("algorithm", "busbw_gbps")), ("scaling", ("mode", "scaling_efficiency")),
    ("checkpointing", ("activation_peak_bytes_checkpointed",)),  # before pipeline's: with --pp it has a schedule
    ("pipeline", ("schedule", "microbatches")), ("overhead", ("side", "round", "precision")),
    ("parallel", ("workload", "strategy")), ("dp", ("workload", "dp_sync")), ("syncbn", ("implementation", "workers")),
    ("verify", ("strategy", "passed")), ("plan", ("predicted_step_s", "measured_step_s")),
    ("sweep", ("layout", "memory_bytes_per_rank", "strategy")),
]


def bench_kind(records) -> str | None:
    """Which distlab bench (or verify) wrote ``records``; None if none did."""
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records):
        return None
    first = records[0]
    return next((kind for kind, keys in _KINDS if all(k in first for k in keys)), None)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# summary.json fields the page draws or tabulates: None, or a finite number (in range, where it has one)
_SUMMARY_NUMBERS = {"test_accuracy": (0.0, 1.0), "test_loss": None, "time_per_step_s_median": None,
                    "samples_per_s": None, "comm_bytes_per_step": None, "model_state_bytes_per_rank": None,
                    "peak_rss_mb": None, "steps": None, "local_batch_size": None}


def _summary_problem(summary) -> str | None:
    """Why a summary.json cannot be drawn (None: it can)."""
    if not isinstance(summary, dict) or "world_size" not in summary:
        return "summary.json is not a distlab run summary (no world_size)"
    if not (isinstance(summary["world_size"], int) and not isinstance(summary["world_size"], bool)
            and summary["world_size"] >= 1):
        return f"summary.json world_size {summary['world_size']!r} is not a number of ranks"
    if not isinstance(summary.get("strategy"), (dict, type(None))):
        return f"summary.json strategy {summary['strategy']!r} is not a strategy object"
    for key, bounds in _SUMMARY_NUMBERS.items():
        v = summary.get(key)
        if v is not None and (not _finite(v) or (bounds and not bounds[0] <= v <= bounds[1])):
            return f"summary.json {key} {v!r} is not " + (f"a number in [{bounds[0]:g}, {bounds[1]:g}]" if bounds
                                                           else "a finite number")
    return None


def _read_run(path: Path, inputs: Inputs) -> None:
    summary, metrics = None, []
    try:
        if (path / "summary.json").is_file():
            summary = json.loads((path / "summary.json").read_text())
            problem = _summary_problem(summary)
            if problem:
                raise ValueError(problem)
        if (path / "metrics.jsonl").is_file():
            for n, line in enumerate((path / "metrics.jsonl").read_text().splitlines(), 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or not _finite(record.get("step")) or \
                            not (record.get("loss") is None or _finite(record["loss"])):
                        raise ValueError(f"metrics.jsonl line {n} has no step and loss numbers")
                    if record["loss"] is not None and (record.get("time_s") is None or _finite(record["time_s"])):
                        metrics.append(record)  # a diverged step (loss null) has no point to draw
    except (ValueError, UnicodeDecodeError, OSError, RecursionError) as exc:
        why = "nested too deeply to read" if isinstance(exc, RecursionError) else str(exc)
        inputs.problems.append((str(path), f"unreadable run: {why[:300]}"))
        return
    if summary is None and not metrics:
        inputs.problems.append((str(path), "failed before the first step: no step logged, no summary"))
        return
    inputs.runs.append({"path": str(path), "summary": summary, "metrics": metrics})
    inputs.read.append((str(path), "run"))


def _read_file(path: Path, inputs: Inputs, explicit: bool) -> None:
    """A JSON file named on the command line (or with a bench file's name) must be usable; any other
    one found in a directory is skipped quietly when it is not distlab's output."""
    quiet = not explicit and path.name not in BENCH_FILES
    try:
        records = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, OSError, RecursionError) as exc:
        if quiet:
            inputs.skipped.append(str(path))
        else:
            why = "nested too deeply to read" if isinstance(exc, RecursionError) else str(exc)[:300]
            inputs.problems.append((str(path), f"not valid JSON: {why}"))
        return
    if isinstance(records, dict) and records.get("kind") == PLAN_VALIDATION:
        records = records.get("runs")  # `distlab plan validate --json`: the per-run rows
    kind = bench_kind(records)
    if kind is None:
        if quiet:
            inputs.skipped.append(str(path))
        else:
            inputs.problems.append((str(path), "not a distlab bench, verify or plan validate file (a list of "
                                               "records it knows)"))
        return
    problem = _records_problem(records)
    if problem:
        inputs.problems.append((str(path), f"{kind} records: {problem}"))
        return
    inputs.bench.setdefault(kind, []).append((str(path), records))
    inputs.read.append((str(path), kind))


def _records_problem(records: list[dict]) -> str | None:
    """A field that holds numbers in some records must hold finite numbers (or null) in all of them."""
    numeric = {k for r in records for k, v in r.items() if _finite(v)}
    for n, r in enumerate(records):
        for key in numeric & set(r):
            v = r[key]
            if v is not None and not _finite(v):
                return f"record {n} has {key} = {str(v)[:40]!r} where numbers are expected"
    return None


def collect(paths: list[str], depth: int = 4) -> Inputs:
    """Read every input; what cannot be used goes into ``problems``."""
    inputs = Inputs()

    def visit(path: Path, level: int, explicit: bool) -> None:
        if not path.exists():
            inputs.problems.append((str(path), "does not exist"))
        elif path.is_file():
            if path.suffix == ".json" or explicit:
                _read_file(path, inputs, explicit)
        elif (path / "summary.json").exists() or (path / "metrics.jsonl").exists():
            _read_run(path, inputs)
        elif level < depth:
            children = sorted(p for p in path.iterdir() if not p.name.startswith("."))
            for child in children:
                if child.is_dir() or child.suffix == ".json":
                    visit(child, level + 1, False)
            if explicit and not any(p for p, _ in inputs.read + inputs.problems if p.startswith(str(path))):
                inputs.problems.append((str(path), "no runs or bench files found in it"))

    for p in paths:
        visit(Path(p), 0, True)
    return inputs


# --------------------------------------------------------------------------- html pieces


_images: list[Path] = []  # render(images=DIR) also writes each plot there: [DIR, written files...]


def _png(fig) -> str:
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
    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


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


def _ms(seconds) -> str:
    return f"{1000 * seconds:.3g}" if seconds < 0.1 else f"{1000 * seconds:,.0f}"


def _size(nbytes) -> str:
    return human_bytes(nbytes)


def _pct(fraction) -> str:
    return f"{100 * fraction:.2f}%"


def _loss(v) -> str:
    return f"{v:.4f}"  # one fixed format: a loss of 4e-07 beside 0 reads 0.0000, not 4.192e-07


def _sci(v) -> str:
    return f"{v:.1e}"


def _date(text) -> str:
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


def _table(rows: list[dict], columns: list[Col]) -> str:
    head = "".join(f"<th>{html.escape(c.header)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{c.cell(r)}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<div class='table'><table><tr>{head}</tr>{body}</table></div>"


def _strategy_label(strategy: dict, world_size: int | None = None) -> str:
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


def _run_label(run: dict) -> str:
    s = run["summary"] or {}
    name = Path(run["path"]).name
    if not s:
        return name
    layout = "one process" if s["world_size"] == 1 else \
        f"x{s['world_size']} {_strategy_label(s.get('strategy') or {}, s['world_size'])}"
    return f"{name} ({layout})"


def _legend(ax, n: int) -> None:
    """Beside the plot, so many runs do not hide the curves."""
    if n:
        ax.legend(fontsize=6 if n > 8 else 7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


# --------------------------------------------------------------------------- sections


def _task(summary: dict | None) -> tuple[str, str, str]:
    """(what the runs do, the loss's unit, what accuracy counts) from a run's summary."""
    if not summary:
        return "runs without a summary.json", "", ""
    if summary.get("loss_unit") == "nats/token":
        return "next-token prediction", "nats/token", "next tokens predicted"
    return "classification", "cross-entropy, nats/sample", "test samples classified"


def _runs_sections(runs: list[dict], problems: list[tuple[str, str]]) -> list[str]:
    """One section per data set and task: only runs that measure the same thing share axes."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        s = r["summary"] or {}
        groups.setdefault((str(s.get("dataset") or ""), _task(r["summary"])[0]), []).append(r)
    return [_runs_section(dataset, rs, problems) for (dataset, _), rs in sorted(groups.items())]


def _runs_section(dataset: str, runs: list[dict], problems: list[tuple[str, str]]) -> str:
    """One data set's runs: loss curves, accuracy bars, the table, scaling, the best run's mistakes; what
    cannot be drawn of one run goes into ``problems`` (path, why)."""
    plt = pyplot()
    task, unit, counted = _task(runs[0]["summary"])
    unit_text = f" ({unit})" if unit else ""
    out = [f"<h2>Training runs: {html.escape(dataset or 'unknown data set')} &mdash; {html.escape(task)}</h2>",
           f"<p>{len(runs)} run(s); losses{html.escape(unit_text)}" + (f", accuracy: {html.escape(counted)}"
                                                                       if counted else "") + ".</p>"]
    with_metrics = [r for r in runs if r["metrics"]]
    if with_metrics:
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
        for i, r in enumerate(with_metrics):
            label, kw = _run_label(r), style(i, len(r["metrics"]))
            a.plot([m["step"] for m in r["metrics"]], [m["loss"] for m in r["metrics"]], label=label, **kw)
            b.plot([m.get("time_s", 0) for m in r["metrics"]], [m["loss"] for m in r["metrics"]], label=label, **kw)
        a.set(xlabel="step", ylabel=f"training loss{unit_text}", title=f"{dataset}: loss vs step")
        b.set(xlabel="wall time (s)", ylabel=f"training loss{unit_text}", title=f"{dataset}: loss vs time")
        _legend(b, len(with_metrics))
        out.append(_png(fig))
    done = [r for r in runs if r["summary"]]
    if done:
        acc = [r for r in done if r["summary"].get("test_accuracy") is not None]
        if acc:  # horizontal bars: a run's label reads along its bar, however many runs
            fig, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * len(acc)))
            values = [100 * r["summary"]["test_accuracy"] for r in acc]
            ax.barh(range(len(acc)), values)
            ax.set_yticks(range(len(acc)), [_run_label(r) for r in acc], fontsize=7)
            ax.invert_yaxis()
            for i, v in enumerate(values):
                ax.text(v, i, f" {v:.2f}%", va="center", fontsize=7)
            ax.set_xlim(0.0, min(100.0, max(values) * 1.12 + 1))  # from 0: a bar's length is its accuracy
            ax.set(xlabel=f"test accuracy (%, {counted})", title=f"{dataset}: test accuracy")
            out.append(_png(fig))
        rows = [{**r["summary"], "run": _short(r["path"]),
                 "strategy_label": _strategy_label(r["summary"].get("strategy") or {}, r["summary"].get("world_size"))}
                for r in done]
        columns = RUN_COLUMNS if unit != "nats/token" else \
            [c if c.key != "test_loss" else Col("test_loss", "test loss (nats/token)") for c in RUN_COLUMNS[:6]] + \
            [Col("test_loss_per_byte", "test loss (nats/byte)"), Col("tokenizer", "tokenizer")] + RUN_COLUMNS[6:]
        out.append(_table(rows, columns))
        out.append(_scaling_from_runs(done))
        out.append(_best_predictions(done, problems))
        out.append(_expert_load([r for r in done if (r["summary"].get("experts") or {}).get("load")]))
    return "\n".join(out)


def _expert_load(runs: list[dict]) -> str:
    """Mixture-of-experts runs: the token-slots each expert received, all layers, one bar group per run
    (a balanced router gives equal bars; the summary's max/mean in the legend)."""
    if not runs:
        return ""
    plt = pyplot()
    width = 0.8 / len(runs)
    experts = max(len(r["summary"]["experts"]["load"]) for r in runs)
    fig, ax = plt.subplots(figsize=(min(12, max(10, 0.5 * experts * len(runs))), 3.8))
    for i, r in enumerate(runs):
        x = r["summary"]["experts"]
        share = [v / max(sum(x["load"]), 1) for v in x["load"]]
        ax.bar([e + i * width for e in range(len(share))], share, width,
               label=f"{_run_label(r)} (max/mean {x['max_over_mean']:.2f}, dropped {100 * x['dropped_fraction']:.1f}%)")
    ax.axhline(1 / experts, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks([e + 0.4 - width / 2 for e in range(experts)], [str(e) for e in range(experts)])
    ax.set(xlabel="expert", ylabel="share of routed token-slots", title="mixture of experts: load per expert "
           "(dashed: balanced)")
    _legend(ax, len(runs))
    return _png(fig)


def _best_predictions(runs: list[dict], problems: list[tuple[str, str]]) -> str:
    """The confusion matrix and mistakes of the section's most accurate classifier (one per section keeps
    the page short; every run's are in its own predictions.npz). A predictions file that cannot be read
    is named and skipped: the next most accurate run's are shown instead."""
    ranked = sorted((r for r in runs if r["summary"].get("predictions")),
                    key=lambda r: -(r["summary"].get("test_accuracy") or 0.0))
    for r in ranked:
        try:
            shown = _predictions(r)
        except Exception as exc:  # noqa: BLE001 - a file distlab did not write as it is now: skip it, say which
            pyplot().close("all")
            problems.append((str(Path(r["path"]) / str(r["summary"]["predictions"])),
                             f"predictions could not be drawn: {type(exc).__name__}: {exc}"[:300]))
            continue
        if shown:
            others = len(ranked) - 1
            return shown + (f"<p>The most accurate run's; {others} other run(s) of this section keep theirs in their "
                            f"predictions.npz.</p>" if others > 0 else "")
    return ""


def _predictions(run: dict) -> str:
    """The final model's confusion matrix and misclassified test images (the run's predictions.npz)."""
    name = (run["summary"] or {}).get("predictions")
    if not isinstance(name, str) or Path(name).name != name or not (Path(run["path"]) / name).is_file():
        return ""
    import numpy as np
    with np.load(Path(run["path"]) / name, allow_pickle=False) as f:
        d = {k: f[k] for k in ("step", "confusion", "images", "labels", "predictions", "class_names")}
    confusion, names = d["confusion"].astype(float), [str(n) for n in d["class_names"]]
    k = len(confusion)
    if confusion.shape != (k, k) or len(names) != k or len(d["images"]) != len(d["labels"]):
        raise ValueError(f"{run['path']}/{name}: arrays of inconsistent shapes")
    plt = pyplot()
    shown = len(d["images"])
    cols = 6
    rows = max(1, -(-shown // cols))
    fig = plt.figure(figsize=(13, max(5.0, 1.25 * rows)))
    grid = fig.add_gridspec(rows, 2 * cols, width_ratios=[1] * cols + [0.55] * cols)
    ax = fig.add_subplot(grid[:, :cols])
    rates = confusion / np.maximum(confusion.sum(1, keepdims=True), 1)
    ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    labels = names if k <= 20 else [str(i) if i % max(1, k // 10) == 0 else "" for i in range(k)]
    ax.set_xticks(range(k), labels, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(k), labels, fontsize=7)
    if k <= 12:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, f"{int(confusion[i, j])}", ha="center", va="center", fontsize=6,
                        color="white" if rates[i, j] > 0.5 else "black")
    ax.set(xlabel="predicted", ylabel="true", title=f"{_run_label(run)}: confusion (step {int(d['step'])}, "
                                                      f"rows sum to 100%)")
    for n in range(shown):
        sub = fig.add_subplot(grid[n // cols, cols + n % cols])
        img = d["images"][n].astype(float)
        img = (img - img.min()) / max(img.max() - img.min(), 1e-12)  # any stored range shown in full
        sub.imshow(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0), cmap="gray" if img.shape[0] == 1
                   else None)
        sub.set_title(f"{names[d['labels'][n]][:10]}\n-> {names[d['predictions'][n]][:10]}", fontsize=6)
        sub.axis("off")
    out = _png(fig)
    return (f"<h3>{html.escape(_run_label(run))}: what the final model gets wrong</h3><p>Confusion matrix of the "
            f"test set (counts; colour: share of the true class) and the first {shown} misclassified test images, "
            f"true -> predicted.</p>{out}")


RUN_COLUMNS = [Col("run", "run"), Col("world_size", "ranks"), Col("strategy_label", "strategy"), Col("steps", "steps"),
               Col("test_accuracy", "test accuracy", _pct), Col("test_loss", "test loss", _loss),
               Col("time_per_step_s_median", "ms/step (median)", _ms), Col("samples_per_s", "samples/s", "{:,.0f}".format),
               Col("comm_bytes_per_step", "sent per step per rank", _size),
               Col("model_state_bytes_per_rank", "model state per rank", _size),
               Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format), Col("torch_version", "torch"),
               Col("hostname", "host"), Col("date", "date", _date)]


def _short(path: str) -> str:
    """The last two parts of a path: enough to tell runs apart in a table."""
    return "/".join(Path(path).parts[-2:])


def _scaling_from_runs(runs: list[dict]) -> str:
    """Samples/s and efficiency vs world size for runs of one model, data set, strategy and per-rank
    batch (weak scaling) at several world sizes."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        s = r["summary"]
        if s.get("samples_per_s"):
            key = (f"{s.get('model')} {s.get('dataset')} {_strategy_label(s.get('strategy') or {})} "
                   f"{s.get('local_batch_size')}/rank")
            groups.setdefault(key, []).append(s)
    groups = {k: v for k, v in groups.items() if len({s["world_size"] for s in v}) > 1}
    if not groups:
        return ""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    rows, all_worlds = [], []
    for i, (name, summaries) in enumerate(groups.items()):
        by_world: dict[int, list[float]] = {}
        for s in summaries:
            by_world.setdefault(s["world_size"], []).append(s["samples_per_s"])
        worlds = sorted(by_world)
        all_worlds += worlds
        sps = [statistics.median(by_world[w]) for w in worlds]
        eff = [x / (w * sps[0] / worlds[0]) for w, x in zip(worlds, sps)]
        a.plot(worlds, sps, label=name, **style(i))
        b.plot(worlds, eff, label=name, **style(i))
        rows += [{"strategy": name, "world_size": w, "samples_per_s": x, "efficiency": e}
                 for w, x, e in zip(worlds, sps, eff)]
    a.set(xlabel="world size", ylabel="samples/s", title="throughput vs world size")
    b.set(xlabel="world size", ylabel="efficiency (per-rank throughput / smallest run's)", title="scaling efficiency")
    for ax in (a, b):
        integer_ticks(ax, all_worlds)
    _legend(b, len(groups))
    cols = [Col("strategy", "model, data, strategy, batch per rank"), Col("world_size", "ranks"),
            Col("samples_per_s", "samples/s (median)", "{:,.0f}".format), Col("efficiency", "scaling efficiency", "{:.2f}".format)]
    return "<h3>Scaling across runs (same per-rank batch)</h3>" + _png(fig) + _table(rows, cols)


def _collectives_section(records: list[dict]) -> str:
    plt = pyplot()
    out = []
    for world in sorted({r["world_size"] for r in records}):
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
        for i, algo in enumerate(dict.fromkeys(r["algorithm"] for r in records)):
            pts = sorted((r["numel"], r["time_s_median"], r["busbw_gbps"]) for r in records
                         if r["world_size"] == world and r["algorithm"] == algo and r["numel"] > 0)
            if pts:
                n, t, bw = zip(*pts)
                a.plot(n, t, label=algo, **style(i))
                b.plot(n, bw, label=algo, **style(i))
        a.set(xscale="log", yscale="log", xlabel="elements", ylabel="median time (s)",
              title=f"all-reduce time, world size {world}")
        b.set(xscale="log", xlabel="elements", ylabel="bus bandwidth (GB/s)", title=f"bus bandwidth, world size {world}")
        _legend(b, len(b.lines))
        out.append(_png(fig))
    cols = [Col("algorithm", "algorithm"), Col("op", "op"), Col("world_size", "ranks"), Col("numel", "elements"),
            Col("dtype", "dtype"), Col("time_s_median", "time (ms, median)", _ms),
            Col("busbw_gbps", "bus bandwidth (GB/s)", "{:.3g}".format), Col("rel_err", "relative error", _sci),
            Col("bytes_sent_per_rank", "sent per rank", _size), Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format)]
    return "\n".join(out) + _table(records, cols)


def _bar(labels: list[str], values: list[float], ylabel: str, title: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(labels)), 3.6))
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, rotation=25, ha="right", fontsize=7)
    ax.set(ylabel=ylabel, title=title)
    return _png(fig)


def _dp_section(records: list[dict]) -> str:
    labels = [f"{r['workload']} x{r['world_size']} {r['dp_sync']}:{r.get('collective', 'native')}" for r in records]
    img = _bar(labels, [r.get("samples_per_s_median") or 0 for r in records], "samples/s", "data parallel: throughput")
    cols = [Col("workload", "workload"), Col("world_size", "ranks"), Col("dp_sync", "method"),
            Col("collective", "collective"), Col("time_per_step_s_median", "ms/step (median)", _ms),
            Col("samples_per_s_median", "samples/s", "{:,.0f}".format),
            Col("comm_bytes_per_step", "sent per step per rank", _size),
            Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format), Col("final_train_loss", "final loss", "{:.4f}".format),
            Col("test_accuracy", "test accuracy", _pct)]
    return img + _table(records, cols)


def _parallel_section(records: list[dict]) -> str:
    ok = [r for r in records if r.get("supported")]
    labels = [f"{r['workload']} {r['strategy']}" for r in ok]
    imgs = _bar(labels, [r["model_state_bytes_per_rank"] / 2**20 for r in ok], "MiB per rank",
                "parameters + gradients + optimizer state per rank")
    imgs += _bar(labels, [r["comm_bytes_per_step"] / 2**20 for r in ok], "MiB per step per rank", "bytes sent per step")
    imgs += _bar(labels, [1000 * r["time_per_step_s_median"] for r in ok], "ms", "time per step (median)")
    cols = [Col("workload", "workload"), Col("strategy", "strategy"), Col("world_size", "ranks"),
            Col("supported", "ran"), Col("time_per_step_s_median", "ms/step (median)", _ms),
            Col("vs_torch", "vs torch", "{:.2f}x".format),
            Col("comm_bytes_per_step", "sent per step per rank", _size),
            Col("model_state_bytes_per_rank", "model state per rank", _size),
            Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format), Col("final_train_loss", "loss", "{:.4f}".format)]
    return imgs + _table(records, cols)


def _pipeline_section(records: list[dict]) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, key in enumerate(dict.fromkeys((r["implementation"], r["schedule"]) for r in records)):
        rs = sorted((r for r in records if (r["implementation"], r["schedule"]) == key), key=lambda r: r["microbatches"])
        ax.plot([r["microbatches"] for r in rs], [1000 * r["time_per_step_s_median"] for r in rs],
                label=" ".join(key), **style(i))
    integer_ticks(ax, [r["microbatches"] for r in records])
    ax.set(xlabel="micro-batches", ylabel="ms per step (median)", title=f"pipeline, {records[0]['stages']} stages")
    _legend(ax, len(ax.lines))
    cols = [Col("schedule", "schedule"), Col("microbatches", "micro-batches"), Col("implementation", "implementation"),
            Col("time_per_step_s_median", "ms/step (median)", _ms), Col("vs_torch", "vs torch", "{:.2f}x".format),
            Col("bubble_measured", "bubble measured", "{:.2f}".format),
            Col("bubble_ideal", "bubble (P-1)/(M+P-1)", "{:.2f}".format),
            Col("activation_peak_bytes_per_stage", "peak activations per stage",
                lambda v: " / ".join(_size(b) for b in v)),
            Col("max_loss_diff_vs_torch", "max |loss diff| vs torch", _sci)]
    return _png(fig) + _table(records, cols)


def _checkpointing_section(records: list[dict]) -> str:
    plt = pyplot()
    labels = [r["workload"] + (f" pp {r['pp']}" if r.get("pp", 1) > 1 else "") + f" {r.get('precision', 'fp32')}"
              for r in records]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(labels)), 3.6))
    x, w = range(len(records)), 0.4
    ax.bar([i - w / 2 for i in x], [r["activation_peak_bytes_plain"] / 2**20 for r in records], w, label="plain")
    ax.bar([i + w / 2 for i in x], [r["activation_peak_bytes_checkpointed"] / 2**20 for r in records], w,
           label="checkpointed")
    ax.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=7)
    ax.set(ylabel="MiB (the largest stage's)", title="held for backward, at the peak")
    _legend(ax, 2)
    cols = [Col("workload", "workload"), Col("pp", "stages"), Col("precision", "precision"), Col("batch", "batch"),
            Col("activation_peak_bytes_plain", "held (plain)", _size),
            Col("activation_peak_bytes_checkpointed", "held (checkpointed)", _size),
            Col("time_per_step_s_plain", "ms/step", _ms), Col("time_per_step_s_checkpointed", "ms/step checkpointed", _ms),
            Col("time_ratio", "time ratio", "{:.2f}x".format), Col("gradients_bitwise_equal", "same gradients")]
    return _png(fig) + _table(records, [c for c in cols if any(c.key in r for r in records)])


def _overhead_section(records: list[dict]) -> str:
    from distlab.bench import overhead
    fig, rows = overhead.figure(records), overhead.summarize(records)
    cols = [Col("workload", "workload"), Col("precision", "precision"), Col("device", "device"),
            Col("plain_s", "plain ms/step", _ms), Col("distlab_s", "distlab ms/step", _ms),
            Col("ratio_median", "distlab / plain", "{:.2f}x".format), Col("ratio_min", "min", "{:.2f}x".format),
            Col("ratio_max", "max", "{:.2f}x".format), Col("rounds", "rounds")]
    return _png(fig) + _table(rows, cols)


def _syncbn_section(records: list[dict]) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, impl in enumerate(dict.fromkeys(r["implementation"] for r in records)):
        pts = sorted((r["workers"], r["time_s_median"] * 1e3) for r in records
                     if r["implementation"] == impl and r.get("available") and r.get("time_s_median"))
        if pts:
            ax.plot(*zip(*pts), label=impl, **style(i))
    ax.set(xlabel="workers", ylabel="median time (ms)", title="batch norm forward + backward")
    integer_ticks(ax, [r["workers"] for r in records])
    _legend(ax, len(ax.lines))
    cols = [Col("implementation", "implementation"), Col("workers", "workers"), Col("features", "features"),
            Col("batch", "batch"), Col("time_s_median", "time (ms, median)", _ms),
            Col("max_abs_out_diff", "max |output diff|", _sci), Col("max_abs_grad_diff", "max |grad diff|", _sci),
            Col("tolerance", "float32 rounding bound", _sci)]
    return _png(fig) + _table(records, [c for c in cols if any(c.key in r for r in records)])


def _scaling_section(records: list[dict]) -> str:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for i, key in enumerate(dict.fromkeys((r["mode"], r["dp_sync"], r.get("bandwidth") or "lo") for r in records)):
        rs = sorted((r for r in records if (r["mode"], r["dp_sync"], r.get("bandwidth") or "lo") == key),
                    key=lambda r: r["world_size"])
        label = " ".join(map(str, key))
        a.plot([r["world_size"] for r in rs], [r["scaling_efficiency"] or 0 for r in rs], label=label, **style(i))
        for r in rs:
            if r.get("loss_curve"):
                t, loss = zip(*r["loss_curve"])
                b.plot(t, loss, label=f"{label} N={r['world_size']}", **style(len(b.lines), len(t)))
    a.set(xlabel="workers", ylabel="scaling efficiency", title="scaling efficiency", ylim=(0, 1.1))
    integer_ticks(a, [r["world_size"] for r in records])
    b.set(xlabel="training time (s)", ylabel="loss", title="loss vs time")
    a.legend(fontsize=7)
    _legend(b, len(b.lines))
    cols = [Col("mode", "mode"), Col("dp_sync", "method"), Col("bandwidth", "link"), Col("world_size", "workers"),
            Col("lr", "LR", "{:.3g}".format), Col("global_batch_size", "global batch"),
            Col("steps_per_epoch", "steps per epoch"), Col("epoch_time_s", "epoch (s)", "{:.2f}".format),
            Col("scaling_efficiency", "efficiency", "{:.2f}".format), Col("sync_share", "sync share", "{:.0%}".format),
            Col("overhead_share", "overhead share", "{:.0%}".format), Col("best_val_loss", "best val loss", "{:.4f}".format),
            Col("test_loss", "test loss", "{:.4f}".format), Col("test_accuracy", "test accuracy", _pct)]
    return _png(fig) + _table(records, cols)


def _verify_section(records: list[dict]) -> str:
    cols = [Col("strategy", "strategy"), Col("world_size", "ranks"), Col("steps", "steps"),
            Col("max_abs_param_diff", "max |param diff|", _sci), Col("max_loss_diff", "max |loss diff|", _sci),
            Col("tolerance", "tolerance", _sci), Col("passed", "passed")]
    return _table(records, cols)


def _plan_section(records: list[dict]) -> str:
    """``distlab plan validate``: predicted vs measured step time, per link and world size."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    markers = "osD^v<>"
    worlds = sorted({r["world_size"] for r in records})
    kinds = list(dict.fromkeys(r.get("kind", "training") for r in records))
    for kind in kinds:
        for link in dict.fromkeys(r["link"] for r in records):
            for i, n in enumerate(worlds):
                rs = [r for r in records if r.get("kind", "training") == kind and r["link"] == link
                      and r["world_size"] == n]
                if rs:
                    ax.scatter([r["measured_step_s"] * 1e3 for r in rs], [r["predicted_step_s"] * 1e3 for r in rs],
                               marker="x+"[i % 2] if kind == "collective" else markers[i % len(markers)],
                               s=18 if kind == "collective" else None, alpha=0.7 if kind == "collective" else 1,
                               label=(f"{kind}s, " if len(kinds) > 1 else "") + f"{link}, {n} workers")
    lo = min(min(r["measured_step_s"], r["predicted_step_s"]) for r in records) * 1e3 / 1.5
    hi = max(max(r["measured_step_s"], r["predicted_step_s"]) for r in records) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="exact")
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.2, label="±20%")
    medians = ", ".join(f"{kind}s {statistics.median(abs(r['time_rel_err']) for r in records if r.get('kind', 'training') == kind):.0%}"
                        for kind in kinds)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms (per step or collective)",
           ylabel="predicted ms",
           title=f"distlab plan: predicted vs measured (median |error|: {medians})")
    ax.legend(fontsize=6)
    cols = [Col("kind", "kind"), Col("run", "run", _short), Col("world_size", "ranks"), Col("link", "link"),
            Col("dp_sync", "method"), Col("zero", "ZeRO"), Col("measured_step_s", "measured (ms)", _ms),
            Col("predicted_step_s", "predicted (ms)", _ms), Col("time_rel_err", "error", "{:+.1%}".format),
            Col("predicted_compute_s", "compute (ms)", _ms), Col("predicted_exposed_comm_s", "exposed comm (ms)", _ms),
            Col("measured_model_state_bytes", "model state measured", _size),
            Col("predicted_model_state_bytes", "model state predicted", _size)]
    return _png(fig) + _table(records, cols)


def _sweep_section(records: list[dict]) -> str:
    """``distlab plan --sweep --json``: memory per rank and scaling efficiency vs world size."""
    plt = pyplot()
    timed = all("step_s" in r for r in records)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 6.5, 4.5), squeeze=False)
    a, b = axes[0][0], axes[0][-1]
    rows = []
    for i, name in enumerate(dict.fromkeys(json.dumps(r["strategy"], sort_keys=True) for r in records)):
        rs = sorted((r for r in records if json.dumps(r["strategy"], sort_keys=True) == name),
                    key=lambda r: r["layout"]["world_size"])
        label = rs[0].get("strategy_text") or ",".join(f"{k}={v}" for k, v in json.loads(name).items()) or "as given"
        worlds = [r["layout"]["world_size"] for r in rs]
        a.plot(worlds, [r["memory_bytes_per_rank"] / 2**30 for r in rs], label=label, **style(i))
        if timed:
            b.plot(worlds, [r["scaling_efficiency"] for r in rs], label=label, **style(i))
        rows += [{**r, "strategy": label, "world_size": w} for w, r in zip(worlds, rs)]
    limit = records[0].get("device_memory_bytes")
    if limit:
        a.axhline(limit / 2**30, color="black", ls="--", lw=1, label="device memory")
    a.set(xscale="log", yscale="log", xlabel="data-parallel ranks", ylabel="GiB per rank",
          title=f"planned memory per rank ({records[0]['num_parameters']:,} parameters)")
    a.legend(fontsize=7)
    if timed:
        b.set(xscale="log", xlabel="data-parallel ranks", ylabel="scaling efficiency", ylim=(0, 1.05),
              title=f"planned scaling efficiency, link {records[0]['link']['name']}")
        b.legend(fontsize=7)
    cols = [Col("strategy", "strategy"), Col("world_size", "ranks"), Col("memory_bytes_per_rank", "memory per rank", _size),
            Col("fits", "fits"), Col("step_s", "step (ms)", _ms), Col("samples_per_s", "samples/s", "{:,.0f}".format),
            Col("scaling_efficiency", "efficiency", "{:.2f}".format)]
    return _png(fig) + _table(rows, cols)


SECTIONS = {"collectives": ("Collectives", _collectives_section), "dp": ("Data parallel", _dp_section),
            "syncbn": ("Synchronized batch norm", _syncbn_section),
            "parallel": ("Tensor parallel and ZeRO", _parallel_section),
            "pipeline": ("Pipeline parallel", _pipeline_section),
            "scaling": ("Scaling", _scaling_section), "verify": ("Equivalence (distlab verify)", _verify_section),
            "plan": ("Cost model (distlab plan validate)", _plan_section),
            "sweep": ("Plan sweep (distlab plan --sweep)", _sweep_section),
            "overhead": ("Single-process overhead (distlab bench overhead)", _overhead_section),
            "checkpointing": ("Activation checkpointing (distlab bench checkpointing)", _checkpointing_section)}


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
            body.extend(_runs_sections(inputs.runs, inputs.problems))
        except Exception as exc:  # noqa: BLE001 - data distlab did not write; the page goes on without it
            inputs.problems += [(r["path"], f"runs could not be drawn: {type(exc).__name__}: {exc}"[:300])
                                for r in inputs.runs]
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
            _table([{"input": p, "kind": k} for p, k in inputs.read], [Col("input", "input"), Col("kind", "kind")])
            if inputs.read else "<p>No usable inputs.</p>"]
    if inputs.skipped:
        head.append(f"<p>{len(inputs.skipped)} other JSON file(s) in the directories searched were skipped: not "
                    f"run, bench, verify or plan validate output (snapshot meta.json, calibrations, ...).</p>")
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
        _images[:] = [Path(images)]
    try:
        atomic_write_text(out, render(inputs, title))
    finally:
        inputs.images = _images[1:]
        _images.clear()
    return inputs
