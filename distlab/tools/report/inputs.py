"""What ``distlab report`` reads: run directories, bench, verify and plan-validation JSON (:func:`collect`),
and why an input it was given cannot be used."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


BENCH_KINDS = ("collectives", "dp", "syncbn", "parallel", "pipeline", "scaling", "verify", "plan", "sweep", "search",
               "overhead", "checkpointing")


BENCH_FILES = {f"{kind}.json" for kind in BENCH_KINDS}  # names the bench commands write: never skipped quietly


PLAN_VALIDATION = "distlab-plan-validation"
PLAN_SEARCH = "distlab-plan-search"


@dataclass
class Inputs:
    runs: list[dict] = field(default_factory=list)        # {"path", "summary", "metrics"}
    bench: dict[str, list[tuple[str, list[dict]]]] = field(default_factory=dict)  # kind -> [(path, records)]
    problems: list[tuple[str, str]] = field(default_factory=list)                # (path, what is wrong)
    read: list[tuple[str, str]] = field(default_factory=list)                    # (path, kind)
    images: list[Path] = field(default_factory=list)                             # PNGs written (--images)
    skipped: list[str] = field(default_factory=list)    # JSON found in a directory that distlab did not write


_KINDS = [  # a bench's JSON by the fields of its first record, in this order
    ("collectives", ("algorithm", "busbw_gbps")), ("scaling", ("mode", "scaling_efficiency")),
    ("checkpointing", ("activation_peak_bytes_checkpointed",)),  # before pipeline's: with --pp it has a schedule
    ("pipeline", ("schedule", "microbatches")), ("overhead", ("side", "round", "precision")),
    ("parallel", ("workload", "strategy")), ("dp", ("workload", "dp_sync")), ("syncbn", ("implementation", "workers")),
    ("verify", ("strategy", "passed")), ("plan", ("predicted_step_s", "measured_step_s")),
    ("search", ("tokens_per_s_per_gpu", "search")), ("sweep", ("layout", "memory_bytes_per_rank", "strategy")),
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
                    "peak_rss_mb": None, "peak_anon_rss_mb": None, "steps": None, "local_batch_size": None}


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
    for key in ("config", "experts", "trace", "mesh", "pipeline", "cluster"):  # objects the page reads into
        if not isinstance(summary.get(key), (dict, type(None))):
            return f"summary.json {key} {str(summary[key])[:40]!r} is not an object"
    for key in ("predictions", "dataset", "model", "loss_unit"):
        if not isinstance(summary.get(key), (str, type(None))):
            return f"summary.json {key} {str(summary[key])[:40]!r} is not a text"
    evals = summary.get("evals")
    if evals is not None and not (isinstance(evals, list) and all(
            isinstance(e, dict) and _finite(e.get("step")) and (e.get("test_loss") is None or _finite(e["test_loss"]))
            and (e.get("val_loss") is None or _finite(e["val_loss"])) for e in evals)):
        return f"summary.json evals {str(evals)[:40]!r} is not a list of evaluations (step, test_loss)"
    experts = summary.get("experts") or {}
    if "load" in experts and not (isinstance(experts["load"], list) and all(_finite(v) for v in experts["load"])):
        return f"summary.json experts.load {str(experts['load'])[:40]!r} is not a list of counts"
    return None


def _read_trace(path: Path, inputs: Inputs) -> dict | None:
    """``path``/trace.json (``--trace``) when it is one: Chrome trace events with numeric times."""
    if not (path / "trace.json").is_file():
        return None
    try:
        trace = json.loads((path / "trace.json").read_text())
        events = trace["traceEvents"]
        for e in events:
            if e["ph"] == "X" and not (_finite(e["ts"]) and _finite(e["dur"]) and isinstance(e["pid"], int)
                                       and isinstance(e["cat"], str) and isinstance(e["name"], str)):
                raise ValueError(f"event {str(e)[:80]} has no numeric ts/dur, rank, lane and name")
        return trace
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OSError, RecursionError) as exc:
        inputs.problems.append((str(path / "trace.json"), f"unreadable trace: {str(exc)[:300]}"))
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
    inputs.runs.append({"path": str(path), "summary": summary, "metrics": metrics, "trace": _read_trace(path, inputs)})
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
    elif isinstance(records, dict) and records.get("kind") == PLAN_SEARCH and isinstance(records.get("ranked"), list):
        search = {k: v for k, v in records.items() if k != "ranked"}  # `plan --search --json`: the ranked layouts,
        records = [{**p, "search": search} for p in records["ranked"] if isinstance(p, dict)]  # each with the search
        if not records:
            inputs.problems.append((str(path), f"a plan search with no layout to draw: {search.get('why')}"[:300]))
            return
    kind = bench_kind(records)
    if kind is None:
        if quiet:
            inputs.skipped.append(str(path))
        else:
            inputs.problems.append((str(path), "not a distlab bench, verify, plan validate or plan search file (a list "
                                               "of records it knows)"))
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
            inside = path.resolve()
            if explicit and not any(Path(p).resolve().is_relative_to(inside) for p, _ in inputs.read + inputs.problems):
                inputs.problems.append((str(path), "no runs or bench files found in it"))

    for p in paths:
        visit(Path(p), 0, True)
    return inputs
