"""A GRPO step split into its rollout (tokens generated a second) and its update (tokens trained a second), on 1
and 2 ranks: interleaved rounds of ``distlab train`` on generated sums, each in fresh processes.

    python scripts/bench_grpo.py --out results/bench-grpo [--runs 3] [--steps 30]

Per run: the median step time, the rollouts' median seconds (``rollout_s`` in metrics.jsonl: gathering the policy,
sampling ``G`` completions of each prompt with the key/value cache, scoring them), the update the rest of the
step; the generated and trained tokens a second over the whole job. Writes OUT/grpo.json; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

GROUP, BATCH, BLOCK = 8, 16, 16


def run(out: Path, nproc: int, steps: int) -> dict:
    threads = max(1, (os.cpu_count() or 2) // nproc)
    subprocess.run([sys.executable, "-m", "distlab", "train", "--model", "gpt", "--n-layer", "2", "--n-embd", "128",
                    "--n-head", "4", "--block-size", str(BLOCK), "--dataset", "synthetic-rl", "--reward", "regex:[0-9]",
                    "--group-size", str(GROUP), "--global-batch-size", str(BATCH), "--max-steps", str(steps),
                    "--log-every", "1", "--lr", "1e-3", "--optimizer", "adamw", "--no-progress", "--nproc-per-node",
                    str(nproc), "--threads", str(threads), "--eval-batches", "1", "--eval-batch-size", "1",
                    "--out", str(out)], check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][3:]  # (warm-up)
    step = summary["time_per_step_s_median"]
    rollout = statistics.median(m["rollout_s"] for m in metrics)
    generated = statistics.median(m["completion_length"] for m in metrics) * BATCH * GROUP
    update = max(step - rollout, 1e-9)
    return {"nproc": nproc, "threads_per_rank": threads, "step_s": step, "rollout_s": rollout, "update_s": update,
            "rollout_share": rollout / step, "generated_tokens_per_s": generated / rollout,
            "trained_tokens_per_s": BATCH * GROUP * BLOCK / update, "load_before_run": summary.get("load_before_run"),
            "date": summary["date"], "torch": summary["torch_version"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench-grpo")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    out = Path(args.out)
    records = [run(out / f"nproc{n}-round{r}", n, args.steps) for r in range(1, args.runs + 1) for n in (1, 2)]
    (out / "grpo.json").write_text(json.dumps(records, indent=1))  # (distlab bench markdown renders it)
    from distlab.bench.markdown import grpo_split
    print(grpo_split(records))


if __name__ == "__main__":
    main()
