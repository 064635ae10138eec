"""Hybrid sharding against ZeRO over every rank on an emulated 2-node cluster: the step time and the bytes that
cross the shaped link between the nodes.

    python scripts/bench_hsdp.py --out results/bench-hsdp [--runs 3] [--steps 60] [--bandwidth 1gbit]   (as root)

Two network namespaces behind a bridge, each node's link shaped to BANDWIDTH both ways (``distlab cluster``), two
workers per node (ranks 0-1 on node 0, 2-3 on node 1; their traffic inside a node goes over its loopback,
unshaped). The main job's MLP (784-512-256-10 on Fashion-MNIST, global batch 64, SGD), ZeRO-2 and ZeRO-3 over all
4 ranks and over shard groups of 2 (one per node: ``--dp-shard 2``), in interleaved rounds of ``distlab train``.
Per run: the median step time, the bytes distlab counted per rank and step, and the bytes the nodes' links
carried (the host side of each veth pair: every packet of the run -- start-up, rendezvous and the final
evaluation included -- over the steps). Writes OUT/hsdp.json; prints a Markdown table (medians of the rounds,
each ratio against ZeRO over every rank the median of the rounds' ratios with its range).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from distlab.launch import cluster as cl
from distlab.launch import cluster_jobs

JOB = ["--model", "mlp", "--dataset", "fashion-mnist", "--global-batch-size", "64", "--optimizer", "sgd", "--lr",
       "0.05", "--momentum", "0.9", "--seed", "0", "--eval-batches", "2", "--log-every", "20", "--no-progress",
       "--threads", "1", "--device", "cpu"]
STRATEGIES = (("zero=3", ["--zero", "3"]), ("zero=3+dp_shard=2", ["--zero", "3", "--dp-shard", "2"]),
              ("zero=2", ["--zero", "2"]), ("zero=2+dp_shard=2", ["--zero", "2", "--dp-shard", "2"]))


def link_bytes(name: str, nodes: int) -> int:
    """Bytes both ways through every node's link so far (the host side of its veth pair)."""
    total = 0
    for i in range(nodes):
        for way in ("rx_bytes", "tx_bytes"):
            total += int(Path(f"/sys/class/net/dl{name}-{i}/statistics/{way}").read_text())
    return total


def train(name: str, out: Path, flags: list[str], steps: int) -> dict:
    cmd = [sys.executable, "-m", "distlab", "train", *JOB, *flags, "--max-steps", str(steps), "--nproc-per-node",
           "2", "--out", str(out)]
    before = link_bytes(name, 2)
    with open(os.devnull, "w") as sink:
        code = cluster_jobs.run(cmd, name, timeout=3600, out=sink)
    if code:
        raise SystemExit(f"exit {code}: {' '.join(cmd)}")
    crossed = link_bytes(name, 2) - before
    summary = json.loads((out / "summary.json").read_text())
    return {"step_s": summary["time_per_step_s_median"], "comm_bytes_per_step": summary["comm_bytes_per_step"],
            "link_bytes_per_step": crossed / summary["steps"], "steps": summary["steps"],
            "test_accuracy": summary.get("test_accuracy"), "model_state_bytes_per_rank":
                summary["model_state_bytes_per_rank"], "date": summary["date"], "torch": summary["torch_version"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/bench-hsdp")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--bandwidth", default="1gbit")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = f"hs{os.getpid() % 10000}"
    records = []
    with cl.private(2, args.bandwidth, max(1, (os.cpu_count() or 2) // 2), name):
        for r in range(args.runs):
            for text, flags in STRATEGIES:
                print(f"round {r + 1}/{args.runs}: {text} ...", flush=True)
                run_dir = out / "runs" / f"{text.replace('+', '_').replace('=', '')}-r{r}"
                records.append({"strategy": text, "round": r, **train(name, run_dir, flags, args.steps)})
    rows = []
    for text, _ in STRATEGIES:
        mine = [x for x in records if x["strategy"] == text]
        base = [x for x in records if x["strategy"] == text.split("+")[0]]
        ratios = [b["step_s"] / m["step_s"] for m, b in zip(mine, base)]
        rows.append({"strategy": text, "runs": len(mine),
                     **{k: statistics.median(x[k] for x in mine) for k in ("step_s", "link_bytes_per_step")},
                     "comm_bytes_per_step": mine[0]["comm_bytes_per_step"],
                     "model_state_bytes_per_rank": mine[0]["model_state_bytes_per_rank"],
                     "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]})
    doc = {"kind": "distlab-hsdp", "bandwidth": args.bandwidth, "steps": args.steps, "nodes": 2,
           "workers_per_node": 2, "threads_per_worker": 1, "cores": os.cpu_count(), "job": JOB, "rows": rows,
           "records": records}
    (out / "hsdp.json").write_text(json.dumps(doc, indent=1))
    from distlab.bench.markdown import hsdp
    print(hsdp(doc))


if __name__ == "__main__":
    main()
