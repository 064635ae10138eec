"""What recording a timeline costs on the main job: its 2-process bucketed run (300 steps of the MLP on
Fashion-MNIST) untraced and with every step traced (``--trace 1:300``), interleaved rounds.

    .venv/bin/python scripts/tracing_cost.py --out results/tracing-cost --runs 5

Writes OUT/tracing.json (one record per run: variant, round, median step) -- ``distlab bench markdown``
renders it: each variant's median step over the rounds and the traced / untraced ratio, the median of
the rounds' ratios with its range.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clipping_cost import measure  # noqa: E402

STEPS = 300
BASE = ["train", "--model", "mlp", "--dataset", "fashion-mnist", "--max-steps", str(STEPS), "--log-every", "1000",
        "--no-progress", "--nproc-per-node", "2", "--dp-sync", "bucketed"]
VARIANTS = (("untraced", []), ("traced", ["--trace", f"1:{STEPS}"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/tracing-cost")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    measure(VARIANTS, BASE, Path(args.out), args.runs, "tracing.json",
            lambda extra: {"traced_steps": STEPS if extra else 0})


if __name__ == "__main__":
    main()
