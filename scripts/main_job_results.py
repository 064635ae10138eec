"""Measure the README's main-job table in one invocation: the same 1-epoch MLP run on 1 and 2
processes, with each gradient-sync method, run one after another on an otherwise idle machine.

    .venv/bin/python scripts/main_job_results.py --out runs/main-job --runs 3

Writes OUT/results.json (every run's summary.json plus machine facts) and prints a Markdown table.
Each run's time/step is the median over its steps (first 5 excluded). With ``--runs R`` the whole
set runs R times, interleaved (round r runs every configuration once); the table shows the median
over rounds, and each ratio is the median of the per-round ratios against that round's
single-process run, with its range.
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

from distlab.bench import mainjob
from distlab.bench.mainjob import RUNS

BASE = ["train", "--model", "mlp", "--dataset", "fashion-mnist", "--epochs", "1", "--log-every", "1000",
        "--no-progress"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/main-job")
    ap.add_argument("--runs", type=int, default=3, help="Rounds of the whole set (median and range reported).")
    args = ap.parse_args()
    out = Path(args.out)
    exe = [str(Path(sys.executable).with_name("distlab"))]
    rounds = []
    for i in range(args.runs):
        results = []
        for name, extra in RUNS:
            run_dir = out / f"round{i}" / (extra[-1] if extra else "single")
            subprocess.run([*exe, *BASE, *extra, "--out", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
            results.append({"name": name, **json.loads((run_dir / "summary.json").read_text())})
        rounds.append(results)
    facts = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
             "cores": os.cpu_count(), "torch": torch.__version__, "command": " ".join(["distlab", *BASE]),
             "rounds": args.runs}
    (out / "results.json").write_text(json.dumps({"facts": facts, "rounds": rounds}, indent=2) + "\n")

    print(mainjob.table({"facts": facts, "rounds": rounds}, markdown=True))
    print(f"\n{facts}")

if __name__ == "__main__":
    main()
