"""The offloaded step overlapped with the next forward (``--offload-overlap``) against the same step waited for:
data parallel over a Llama-shaped model (8 x 512, SwiGLU 2048, 8 heads / 4 key-value groups; byte vocabulary: 25 M
parameters), AdamW, its moments in a file a rank (``--offload optimizer``), on 1 rank (the step's thread has a core
of its own) and on 2 (every core already computes); and ZeRO-3 on 2 ranks with its parameter shards in the file too
(``--offload params``) -- in interleaved rounds of ``distlab train`` (fresh processes, 1 thread a rank).

    python scripts/bench_offload_overlap.py --out results/bench-offload-overlap [--runs 3] [--steps 20]

Per run: the median step time and how long the training thread waited for the steps (the summary's
``offload.overlap``: in the forwards, where the overlap left them unhidden, and in all). Writes OUT/overlap.json;
prints a Markdown table (medians of the rounds, their range; each speedup the median of the rounds' ratios).
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

MODEL = ["--model", "llama", "--n-layer", "8", "--n-head", "8", "--kv-heads", "4", "--n-embd", "512",
         "--ffn-hidden", "2048", "--block-size", "64", "--dataset", "synthetic-text:400000",
         "--global-batch-size", "2", "--optimizer", "adamw", "--lr", "3e-4", "--weight-decay", "0.1"]
# (layout, ranks, its flags): data parallel on 1 rank and on 2; ZeRO-3 on 2, its parameter shards offloaded too
LAYOUTS = (("dp", 1, ["--offload", "optimizer"]), ("dp", 2, ["--offload", "optimizer"]),
           ("zero=3", 2, ["--zero", "3", "--offload", "params"]))


def train(out: Path, layout: str, ranks: int, flags: list[str], overlap: bool, steps: int, scratch: Path) -> dict:
    flags = [*flags, "--offload-dir", str(scratch), *(["--offload-overlap"] if overlap else [])]
    proc = subprocess.run([sys.executable, "-m", "distlab", "train", *MODEL, *flags, "--nproc-per-node", str(ranks),
                           "--global-batch-size", str(8 * ranks), "--threads", "1", "--max-steps", str(steps),
                           "--lr-schedule", "constant", "--log-every", "1000", "--eval-batches", "1",
                           "--eval-batch-size", "2", "--no-progress", "--comm-timeout", "600", "--out", str(out)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"distlab train ({layout}, {ranks} ranks, overlap {overlap}) failed:\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    for dropped in ("model.safetensors", "model.safetensors.sha256", ".distlab-lock"):  # (the numbers stay)
        (out / dropped).unlink(missing_ok=True)
    waited = s["offload"].get("overlap") or {}
    return {"layout": layout, "ranks": ranks, "overlap": overlap, "step_s": s["time_per_step_s_median"],
            "waited_s": waited.get("waited_s"), "forward_waited_s": waited.get("forward_waited_s"),
            "final_train_loss": s.get("final_train_loss"), "date": s["date"], "torch": s["torch_version"],
            "cores": s.get("cores"), "load_before_run": s.get("load_before_run")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench-offload-overlap")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--scratch", default=None, help="Where the offload files go (default: a temporary directory).")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for r in range(1, args.runs + 1):
        for layout, ranks, flags in LAYOUTS:
            for overlap in (False, True):
                scratch = Path(tempfile.mkdtemp(dir=args.scratch, prefix="distlab-overlap-"))
                name = f"{layout.replace('=', '')}-x{ranks}-{'overlap' if overlap else 'wait'}-{r}"
                try:
                    records.append({"round": r, **train(out / name, layout, ranks, flags, overlap, args.steps,
                                                        scratch)})
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
                print(json.dumps(records[-1]), flush=True)
    rows = []
    for layout, ranks, flags in LAYOUTS:
        for overlap in (False, True):
            alike = [x for x in records if x["layout"] == layout and x["ranks"] == ranks]
            mine = [x for x in alike if x["overlap"] == overlap]
            waited = [x for x in alike if not x["overlap"]]
            ratios = [w["step_s"] / x["step_s"] for w, x in zip(waited, mine)]  # (each round's)
            row = {"layout": layout, "offload": flags[-1], "ranks": ranks, "overlap": overlap, "runs": len(mine),
                   "step_s": statistics.median(x["step_s"] for x in mine),
                   "step_s_range": [min(x["step_s"] for x in mine), max(x["step_s"] for x in mine)],
                   "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
                   "same_loss": len({x["final_train_loss"] for x in mine + waited}) == 1}
            if overlap:
                row |= {k: statistics.median(x[k] for x in mine) for k in ("waited_s", "forward_waited_s")}
            rows.append(row)
    (out / "overlap.json").write_text(json.dumps({"kind": "distlab-offload-overlap", "steps": args.steps,
                                                  "model": MODEL, "rows": rows, "records": records}, indent=1))
    from distlab.bench.markdown import offload_overlap
    print(offload_overlap(json.loads((out / "overlap.json").read_text())))


if __name__ == "__main__":
    main()
