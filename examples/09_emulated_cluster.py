"""Scaling out on an emulated cluster -- and predicting it before running it.

    sudo python examples/09_emulated_cluster.py [WORKDIR]      (root: network namespaces and tc)

Two "nodes" (network namespaces joined by a bridge, each link shaped to 1 Gbit/s with tc) train
the same MLP with DDP; the one-worker run on this machine is the baseline. Then ``distlab plan``
calibrated from that one-worker run and from the collectives measured on this machine
(results/plan/bench-collectives, committed with the README's numbers) predicts the two-node step
time from the link's nominal rate alone, and the script prints both. About 30 s on 2 cores.
Tutorial: docs/09-scaling-out.md.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from distlab.runtime.device import load_stretch  # a hang guard that a busy machine does not meet

REPO = Path(__file__).resolve().parent.parent
NAME, RATE, STEPS = "ex09", "1gbit", 60


def distlab(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "DISTLAB_KILL_AT_STEP")}
    proc = subprocess.run([sys.executable, "-m", "distlab", *args], capture_output=True, text=True, timeout=300 * load_stretch(),
                          env=env)
    if check and proc.returncode != 0:
        raise SystemExit(f"distlab {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_args(out: Path) -> list[str]:
    return ["train", "--device", "cpu", "--threads", "1", "--dataset", "synthetic:1x28x28:10:4096",
            "--global-batch-size", "64", "--max-steps", str(STEPS), "--dp-sync", "ddp", "--optimizer", "sgd", "--no-progress",
            "--log-every", "20", "--comm-timeout", "60", "--out", str(out)]


def main(root: Path) -> None:
    if os.geteuid() != 0:
        print("skipped: the emulated cluster needs root (network namespaces, veth, tc)")
        return
    # one worker: the baseline, and the compute calibration
    distlab(*train_args(root / "one"), "--global-batch-size", "32")
    distlab("cluster", "down", "--name", NAME, check=False)
    up = distlab("cluster", "up", "--nodes", "2", "--bandwidth", RATE, "--cores-per-node", "1", "--name", NAME,
                 check=False)
    if up.returncode != 0:
        print(f"skipped: could not build the emulated cluster here: {up.stderr.strip()[-300:]}")
        return
    try:
        distlab("cluster", "run", "--name", NAME, "--", sys.executable, "-m", "distlab", *train_args(root / "two"),
                "--nproc-per-node", "1")
    finally:
        distlab("cluster", "down", "--name", NAME, check=False)
    one = json.loads((root / "one" / "summary.json").read_text())
    two = json.loads((root / "two" / "summary.json").read_text())
    print(f"one worker, batch 32:           {one['time_per_step_s_median'] * 1e3:7.2f} ms/step")
    print(f"two nodes at {RATE}, batch 2x32: {two['time_per_step_s_median'] * 1e3:7.2f} ms/step "
          f"(efficiency {one['time_per_step_s_median'] / two['time_per_step_s_median']:.2f}; "
          f"{two['comm_bytes_per_step']:,} bytes sent per step)")

    cal = root / "calibration.json"
    distlab("plan", "calibrate", str(REPO / "results" / "plan" / "bench-collectives"), str(root / "one"), "-o", str(cal))
    plan = distlab("plan", "--model", "mlp", "--dp", "2", "--dp-sync", "ddp", "--global-batch", "64",
                   "--optimizer", "sgd", "--link", RATE, "--burst", "512kb", "--threads", "1", "--calibration", str(cal),
                   "--json", str(root / "plan.json"))
    print("\ndistlab plan, before running it:")
    print("  " + plan.stdout.strip().replace("\n", "\n  "))
    predicted = json.loads((root / "plan.json").read_text())["step_s"]
    err = (predicted - two["time_per_step_s_median"]) / two["time_per_step_s_median"]
    print(f"predicted {predicted * 1e3:.2f} ms/step vs measured {two['time_per_step_s_median'] * 1e3:.2f} ms/step: "
          f"{err:+.0%}")
    assert two["model_state_bytes_per_rank"] == json.loads((root / "plan.json").read_text())["model_state_bytes_per_rank"]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as d:
            main(Path(d))
