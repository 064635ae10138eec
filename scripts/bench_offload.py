"""Offload's memory and its price: ZeRO-3 on 2 ranks over Llama 3.2 1B's shape (16 x 2048, 32 query / 8 key-value
heads, SwiGLU 8192; byte vocabulary: 0.97 B parameters), AdamW, with everything on the device, the optimizer's
state offloaded (``--offload optimizer``) and the parameter shards too (``--offload params``), to a file a rank,
in interleaved rounds of ``distlab train`` (fresh processes; 1 thread a rank on this machine's cores).

    python scripts/bench_offload.py --out results/bench-offload [--runs 3] [--steps 4]

Per run: the peak resident memory of the steps per rank (``peak_rss_steps_mb``: ru_maxrss when the last step ended,
file pages mapped included; and the largest anonymous share read), the model state the device holds and what the
files hold -- each against ``distlab plan``'s prediction --, the bytes offload moves a step (planned), and the
median step time. Writes OUT/offload.json; prints a Markdown table (medians of the rounds, their range).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--model", "llama", "--n-layer", "16", "--n-head", "32", "--kv-heads", "8", "--n-embd", "2048",
         "--ffn-hidden", "8192", "--rope-theta", "500000", "--block-size", "32", "--dataset", "synthetic-text:400000",
         "--global-batch-size", "2", "--optimizer", "adamw"]
TRAINING = ["--lr", "3e-4", "--weight-decay", "0.1"]
LAYOUT = ["--zero", "3"]
MODES = ("none", "optimizer", "params")


def planned(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "distlab", "plan", *MODEL, *LAYOUT, "--dp", "2", "--offload", mode,
                        "--json", f"{d}/plan.json"], check=True, capture_output=True, text=True)
        return json.loads(Path(d, "plan.json").read_text())


def train(out: Path, mode: str, steps: int, scratch: Path) -> dict:
    offload = ["--offload", mode, "--offload-dir", str(scratch / "offload")] if mode != "none" else []
    proc = subprocess.run([sys.executable, "-m", "distlab", "train", *MODEL, *TRAINING, *LAYOUT, *offload, "--nproc-per-node", "2",
                           "--threads", "1", "--max-steps", str(steps),
                           "--lr-schedule", "constant", "--log-every", "1", "--eval-batches", "1", "--eval-batch-size", "2",
                           "--no-progress", "--comm-timeout", "600", "--out", str(out),
                           # a final snapshot (each rank's shards) instead of the final model file: the whole model
                           # gathered on every rank does not fit beside the state here
                           "--snapshot-dir", str(scratch / "snapshots"), "--snapshot-every", "1000"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"distlab train --offload {mode} failed:\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"mode": mode, "peak_rss_steps_mb": s["peak_rss_steps_mb"], "peak_rss_mb": s["peak_rss_mb"],
            "peak_anon_rss_mb": s.get("peak_anon_rss_mb"), "step_s": s["time_per_step_s_median"],
            "model_state_bytes_per_rank": s["model_state_bytes_per_rank"],
            "offload_bytes_per_rank": (s.get("offload") or {}).get("bytes_per_rank", 0),
            "final_train_loss": s.get("final_train_loss"), "date": s["date"], "torch": s["torch_version"],
            "cores": s.get("cores"), "load_before_run": s.get("load_before_run")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench-offload")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--scratch", default=None, help="Where the offload files go (default: a temporary directory).")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans = {m: planned(m) for m in MODES}
    records = []
    for r in range(1, args.runs + 1):
        for mode in MODES:
            scratch = Path(tempfile.mkdtemp(dir=args.scratch, prefix="distlab-offload-"))
            try:
                records.append({"round": r, **train(out / f"{mode}-{r}", mode, args.steps, scratch)})
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            print(json.dumps(records[-1]), flush=True)
    rows = []
    for mode in MODES:
        mine = [x for x in records if x["mode"] == mode]
        p = plans[mode]
        rows.append({"mode": mode, "runs": len(mine),
                     **{k: statistics.median(x[k] for x in mine) for k in ("peak_rss_steps_mb", "step_s")},
                     "peak_rss_steps_range": [min(x["peak_rss_steps_mb"] for x in mine),
                                              max(x["peak_rss_steps_mb"] for x in mine)],
                     "step_s_range": [min(x["step_s"] for x in mine), max(x["step_s"] for x in mine)],
                     "peak_anon_rss_mb": statistics.median(x["peak_anon_rss_mb"] or 0 for x in mine),
                     "model_state_bytes_per_rank": mine[0]["model_state_bytes_per_rank"],
                     "planned_model_state_bytes_per_rank": p["model_state_bytes_per_rank"],
                     "offload_bytes_per_rank": mine[0]["offload_bytes_per_rank"],
                     "planned_offload_bytes_per_rank": (p.get("offload") or {}).get("bytes_per_rank", 0),
                     "planned_moved_bytes_per_step": (p.get("offload") or {}).get("moved_bytes_per_step", 0)})
    base = rows[0]
    for row in rows:
        row["rss_vs_full"] = row["peak_rss_steps_mb"] / base["peak_rss_steps_mb"]
        row["step_vs_full"] = row["step_s"] / base["step_s"]
    (out / "offload.json").write_text(json.dumps({"kind": "distlab-offload", "steps": args.steps, "model": MODEL,
                                                  "layout": LAYOUT, "ranks": 2, "rows": rows, "records": records},
                                                 indent=1))
    from distlab.bench.markdown import offload
    print(offload(json.loads((out / "offload.json").read_text())))


if __name__ == "__main__":
    main()
