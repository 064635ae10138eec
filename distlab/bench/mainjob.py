"""The main job's table: the same 1-epoch MLP run on 1 and 2 processes with each gradient-sync method,
several interleaved rounds (``scripts/main_job_results.py`` measures it; ``OUT/results.json`` holds
every run's summary.json by round and the machine's facts)."""

from __future__ import annotations

import statistics

from distlab.bench.common import format_table

RUNS = [
    ("1 process", []),
    ("2 processes, --dp-sync gather-scatter", ["--nproc-per-node", "2", "--dp-sync", "gather-scatter"]),
    ("2 processes, --dp-sync allreduce", ["--nproc-per-node", "2", "--dp-sync", "allreduce"]),
    ("2 processes, --dp-sync bucketed (the default)", ["--nproc-per-node", "2", "--dp-sync", "bucketed"]),
    ("2 processes, --dp-sync ddp", ["--nproc-per-node", "2", "--dp-sync", "ddp"]),
]


def is_results(data) -> bool:
    """Whether ``data`` (a parsed JSON file) is the main job's results.json."""
    return isinstance(data, dict) and isinstance(data.get("rounds"), list) and isinstance(data.get("facts"), dict)


def table(data: dict, markdown: bool = False) -> str:
    """Per configuration: the median test accuracy, time/step and samples/s over rounds, and the median
    (with range) of the per-round speed ratios against that round's single-process run."""
    rounds = data["rounds"]
    rows = []
    for j, first in enumerate(rounds[0]):
        runs = [r[j] for r in rounds]
        ratios = [r[0]["time_per_step_s_median"] / r[j]["time_per_step_s_median"] for r in rounds]
        rows.append([f"{first['name']} ({first['world_size']} x {first.get('threads_per_rank', '?')} "
                     f"thread{'' if first.get('threads_per_rank') == 1 else 's'})",
                     f"{100 * statistics.median(r['test_accuracy'] for r in runs):.2f}%",
                     f"{1000 * statistics.median(r['time_per_step_s_median'] for r in runs):.2f} ms",
                     f"{statistics.median(r['samples_per_s'] for r in runs):,.0f}",
                     f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                     f"{first['comm_bytes_per_step']:,}"])
    return format_table(["run", "test accuracy", "time/step (median)", "samples/s", "vs 1 process (range)",
                         "bytes sent/step/rank"], rows, markdown)
