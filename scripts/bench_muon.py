"""Muon against AdamW (``--optimizer muon``): a GPT on the fortunes, the same steps, learning rate, weight decay and
seed, in interleaved rounds of ``distlab train``, each in a fresh process.

    python scripts/bench_muon.py --out results/bench-muon [--runs 3] [--steps 400] [--lr 3e-3]

Per run: the final train loss (the mean of the last 5 logged), the test loss, the median step time and the model
state a rank holds. Writes OUT/muon.json; prints a Markdown table (medians of the rounds, their range).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_optimizer_state import MODEL, train  # (the same GPT, data and run)


def run(out: Path, optimizer: str, steps: int, seed: int, lr: float) -> dict:
    return {"optimizer": optimizer, "lr": lr, **train(out, ["--optimizer", optimizer, "--lr", str(lr)], steps, seed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench-muon")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = [run(out / f"{name}-seed{r}", name, args.steps, r, args.lr) for r in range(1, args.runs + 1)
               for name in ("adamw", "muon")]
    rows = []
    for name in ("adamw", "muon"):
        mine = [r for r in records if r["optimizer"] == name]
        rows.append({"optimizer": name, "runs": len(mine), "lr": args.lr,
                     **{k: statistics.median(r[k] for r in mine) for k in ("final_train_loss", "test_loss", "step_s")},
                     "test_loss_range": [min(r["test_loss"] for r in mine), max(r["test_loss"] for r in mine)],
                     "model_state_bytes_per_rank": mine[0]["model_state_bytes_per_rank"]})
    doc = {"kind": "distlab-muon", "steps": args.steps, "model": MODEL, "rows": rows, "records": records}
    (out / "muon.json").write_text(json.dumps(doc, indent=1))
    from distlab.bench.markdown import muon
    print(muon(doc))


if __name__ == "__main__":
    main()
