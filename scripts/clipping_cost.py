"""What gradient clipping by the global norm costs on the main job: its 2-process bucketed run (one
epoch of the MLP on Fashion-MNIST) with and without ``--clip-grad-norm``, interleaved rounds.

    .venv/bin/python scripts/clipping_cost.py --out results/clipping-cost --runs 3

Writes OUT/clipping.json (one record per run: variant, round, median step) -- ``distlab bench
markdown`` renders it: each variant's median step over the rounds and the clipped / plain ratio, the
median of the rounds' ratios with its range.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distlab.bench.common import machine  # noqa: E402

BASE = ["train", "--model", "mlp", "--dataset", "fashion-mnist", "--epochs", "1", "--log-every", "1000",
        "--no-progress", "--nproc-per-node", "2", "--dp-sync", "bucketed"]
VARIANTS = (("plain", []), ("clipped", ["--clip-grad-norm", "1.0"]))


def measure(variants, base: list[str], out: Path, runs: int, name: str, fields) -> list[dict]:
    """Each ``(variant, extra flags)`` of ``distlab BASE`` once per round, rounds interleaved; one record
    per run (``fields(extra)`` adds the variant's own), written to OUT/NAME and rendered."""
    exe = [sys.executable, "-m", "distlab"]
    records = []
    for r in range(runs):
        for variant, extra in variants:
            run_dir = out / f"round{r}" / variant
            subprocess.run([*exe, *base, *extra, "--out", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
            s = json.loads((run_dir / "summary.json").read_text())
            records.append({"variant": variant, "round": r, **fields(extra),
                            "time_per_step_s_median": s["time_per_step_s_median"], "test_accuracy": s["test_accuracy"],
                            "command": " ".join(["distlab", *base, *extra]), "date": time.strftime("%Y-%m-%d"),
                            **machine(2, 1)})
    (out / name).write_text(json.dumps(records, indent=1) + "\n")
    from distlab.bench.markdown import render
    print(render(out / name))
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/clipping-cost")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    measure(VARIANTS, BASE, Path(args.out), args.runs, "clipping.json",
            lambda extra: {"clip_grad_norm": 1.0 if extra else None})


if __name__ == "__main__":
    main()
