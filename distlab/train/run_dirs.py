"""What a run's directories already hold, read before a run writes into them: another run's snapshots
in ``snapshot_dir`` or its metrics and summary in ``out`` (a fresh run refuses them, a resume must be of
the run that wrote them), the summary of a run that finished, and the last step its metrics logged."""

from __future__ import annotations

import json
from pathlib import Path

from distlab.train import snapshot


def _summary(out: str | None) -> dict | None:
    """``out``'s summary.json (None: none, or unreadable)."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text()) if out else None
    except (OSError, ValueError, RecursionError):
        return None
    return summary if isinstance(summary, dict) else None


def _first_record(out: str) -> dict | None:
    try:
        with (Path(out) / "metrics.jsonl").open() as f:
            record = json.loads(f.readline())
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def finished_summary(out: str | None, run_id: str | None) -> dict | None:
    """``out``'s summary.json when it says run ``run_id`` completed (None otherwise)."""
    summary = _summary(out)
    if summary and summary.get("run_id") == run_id and summary.get("stopped") in (None, "completed"):
        return summary
    return None


def directory_problem(snapshot_dir: str | None, out: str | None, run_id: str | None, fresh: bool,
                      history: list[dict] | None = None) -> str | None:
    """Why run ``run_id`` may not use these directories (None: it may).

    ``snapshot_dir`` must hold no other run's snapshots (a fresh run would otherwise prune them by
    step number, or a later ``--resume auto`` would pick up the wrong run). ``out`` must not hold
    another run's ``metrics.jsonl`` or ``summary.json`` (they would be overwritten): for a ``fresh``
    run none at all; for a resumed one only its own (the run id in summary.json, else the first
    logged record, which the snapshot's ``history`` repeats). ``run_id=""`` stands for a run that
    has no id yet (every snapshot is another's).
    """
    theirs = snapshot.foreign(snapshot_dir, run_id)
    if theirs:
        return (f"`snapshot_dir` {snapshot_dir} holds {len(theirs)} snapshot(s) of another run (newest "
                f"{theirs[0].name}): continue that run with `resume` auto, or give this run its own `snapshot_dir`")
    if not out:
        return None
    # an empty metrics.jsonl is a run that failed before it logged a step: nothing of it to keep
    held = [name for name in ("summary.json", "metrics.jsonl") if (Path(out) / name).exists() and
            (name == "summary.json" or (Path(out) / name).stat().st_size > 0)]
    if not held:
        return None
    summary = _summary(out)
    if fresh:
        where = summary.get("snapshot") if summary else None
        go_on = (f", or continue that run with `resume` auto `snapshot_dir` {Path(where).parent}"
                 if where and Path(where).is_dir() else " (it left no snapshot to continue from)")
        return (f"`out` {out} already holds a run ({' and '.join(held)}): give this run another `out` "
                f"(the default makes a new one per run){go_on}")
    theirs_id = summary.get("run_id") if summary else None
    if summary is not None and theirs_id != run_id:
        return (f"`out` {out} holds run {theirs_id}, this run resumes run {run_id}: give the `out` this run "
                f"wrote before, or another one")
    if summary is None and history:
        first = _first_record(out)
        if first is not None and first.get("step") == history[0].get("step") and first != history[0]:
            return (f"`out` {out} holds the metrics of another run than the one resumed ({run_id}): give the "
                    f"`out` this run wrote before, or another one")
    return None


def last_logged_step(out: str | None) -> int | None:
    """The last step in ``out``'s ``metrics.jsonl`` (None: no such file or no step in it)."""
    path = Path(out) / "metrics.jsonl" if out else None
    if path is None or not path.is_file():
        return None
    step = None
    with path.open() as f:
        for line in f:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
    return step
