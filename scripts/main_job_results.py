"""Measure the README's main-job table in one invocation: the same 1-epoch MLP run on 1 and 2
processes, with each gradient-sync method, run one after another on an otherwise idle machine.

    .venv/bin/python scripts/main_job_results.py --out runs/main-job

Writes OUT/results.json (every run's summary.json plus machine facts) and prints a Markdown table.
Each time/step is the median over the run's steps (first 5 excluded); ratios are against the
single-process run of the same invocation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

RUNS = [
    ("1 process", []),
    ("2 processes, --dp-sync gather-scatter", ["--nproc-per-node", "2", "--dp-sync", "gather-scatter"]),
    ("2 processes, --dp-sync allreduce", ["--nproc-per-node", "2", "--dp-sync", "allreduce"]),
    ("2 processes, --dp-sync bucketed (the default)", ["--nproc-per-node", "2", "--dp-sync", "bucketed"]),
    ("2 processes, --dp-sync ddp", ["--nproc-per-node", "2", "--dp-sync", "ddp"]),
]
BASE = ["train", "--model", "mlp", "--dataset", "fashion-mnist", "--epochs", "1", "--log-every", "1000",
        "--no-progress"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/main-job")
    args = ap.parse_args()
    out = Path(args.out)
    exe = [str(Path(sys.executable).with_name("distlab"))]
    results = []
    for name, extra in RUNS:
        run_dir = out / name.split(",")[0].replace(" ", "-") / (extra[-1] if extra else "single")
        subprocess.run([*exe, *BASE, *extra, "--out", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
        results.append({"name": name, **json.loads((run_dir / "summary.json").read_text())})
    facts = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
             "cores": os.cpu_count(), "torch": torch.__version__, "command": " ".join(["distlab", *BASE])}
    (out / "results.json").write_text(json.dumps({"facts": facts, "runs": results}, indent=2) + "\n")

    base = results[0]["time_per_step_s_median"]
    print(f"| run | test accuracy | time/step (median) | samples/s | vs 1 process | bytes sent/step/rank | wall time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        t = r["time_per_step_s_median"]
        print(f"| {r['name']} ({r['world_size']} x {r['threads_per_rank']} threads) | {100 * r['test_accuracy']:.2f}% | "
              f"{1000 * t:.2f} ms | {r['samples_per_s']:,.0f} | {base / t:.2f}x | {r['comm_bytes_per_step']:,} | "
              f"{r['wall_time_s']:.1f} s |")
    print(f"\n{facts}")


if __name__ == "__main__":
    main()
