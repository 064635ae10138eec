"""Adam's moments in float32 against bfloat16 (``--optimizer-state``): a GPT on the fortunes, AdamW, the same steps
and seed, in interleaved rounds of ``distlab train``, each in a fresh process.

    python scripts/bench_optimizer_state.py --out results/bench-optimizer-state [--runs 3] [--steps 400]

Per run: the final train loss (the mean of the last 5 logged), the test loss, the median step time and the model
state a rank holds. Writes OUT/optimizer-state.json; prints a Markdown table (medians of the rounds, their range).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = ["--model", "gpt", "--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--block-size", "64"]


def train(out: Path, flags: list[str], steps: int, seed: int) -> dict:
    """One run of the GPT on the fortunes with the optimizer ``flags``: what it measured."""
    subprocess.run([sys.executable, "-m", "distlab", "train", *MODEL, "--dataset", "fortunes", "--global-batch-size",
                    "32", "--max-steps", str(steps), "--weight-decay", "0.1", *flags, "--seed", str(seed),
                    "--log-every", "10", "--no-progress", "--threads", str(os.cpu_count() or 2), "--out", str(out)],
                   check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, "final_train_loss": statistics.mean(losses[-5:]),
            "test_loss": summary.get("test_loss"), "step_s": summary["time_per_step_s_median"],
            "model_state_bytes_per_rank": summary["model_state_bytes_per_rank"],
            "load_before_run": summary.get("load_before_run"), "date": summary["date"],
            "torch": summary["torch_version"]}


def run(out: Path, state: str, steps: int, seed: int) -> dict:
    return {"state": state, **train(out, ["--optimizer", "adamw", "--lr", "3e-3", "--optimizer-state", state], steps,
                                    seed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench-optimizer-state")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = [run(out / f"{state}-seed{r}", state, args.steps, r) for r in range(1, args.runs + 1)
               for state in ("fp32", "bf16")]
    rows = []
    for state in ("fp32", "bf16"):
        mine = [r for r in records if r["state"] == state]
        rows.append({"state": state, "runs": len(mine),
                     **{k: statistics.median(r[k] for r in mine) for k in ("final_train_loss", "test_loss", "step_s")},
                     "test_loss_range": [min(r["test_loss"] for r in mine), max(r["test_loss"] for r in mine)],
                     "model_state_bytes_per_rank": mine[0]["model_state_bytes_per_rank"]})
    (out / "optimizer-state.json").write_text(json.dumps({"kind": "distlab-optimizer-state", "steps": args.steps,
                                                          "model": MODEL, "rows": rows, "records": records}, indent=1))
    print("| moments | runs | final train loss | test loss (range) | ms/step | model state |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["test_loss_range"]
        print(f"| {r['state']} | {r['runs']} | {r['final_train_loss']:.4f} | {r['test_loss']:.4f} "
              f"({lo:.4f}-{hi:.4f}) | "
              f"{r['step_s'] * 1e3:.0f} | {r['model_state_bytes_per_rank']:,} B |")


if __name__ == "__main__":
    main()
