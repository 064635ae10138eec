"""Fault tolerance: a worker dies mid-epoch, torchrun restarts the group, training resumes from the
last snapshot -- and ends exactly where an uninterrupted run ends. Then a corrupt snapshot is refused.

    python examples/08_fault_tolerance.py [WORKDIR]

Drives the real CLI the way you would from a shell: three 2-process ``distlab train`` jobs on
synthetic data (about 10 s each on 2 cores). Rank 1 of the second job SIGKILLs itself right after
step 13, before that step's log line (``DISTLAB_KILL_AT_STEP``, a test hook: the launcher names step 12, the
last logged); ``--max-restarts 1`` lets torchrun's elastic
agent start a new group, whose workers find the newest snapshot (step 10) on their own.
Tutorial: docs/08-fault-tolerance.md.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from distlab.runtime.device import load_stretch  # a hang guard that a busy machine does not meet

STEPS, EVERY, KILL_AFTER = 24, 5, 13


def train(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "distlab", "train", "--nproc-per-node", "2", "--device", "cpu",
           "--dataset", "synthetic:1x16x16:10:2048", "--mlp-widths", "64,32", "--global-batch-size", "32",
           "--max-steps", str(STEPS), "--log-every", "1", "--no-progress", "--comm-timeout", "30",
           "--snapshot-every", str(EVERY), "--snapshot-dir", str(out / "snapshots"), "--out", str(out / "run"), *extra]
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "DISTLAB_KILL_AT_STEP")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300 * load_stretch(), env={**clean, **(env or {})})


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()]


def main(root: Path) -> None:
    straight = train(root / "straight")
    assert straight.returncode == 0, straight.stderr
    killed = train(root / "killed", "--max-restarts", "1", env={"DISTLAB_KILL_AT_STEP": f"1:{KILL_AFTER}"})
    assert killed.returncode == 0, killed.stderr
    summary = json.loads((root / "killed" / "run" / "summary.json").read_text())
    print(f"killed run: rank 1 died right after step {KILL_AFTER}, before logging it (the launcher names step "
          f"{KILL_AFTER - 1}, the last logged); {summary['restart_count']} restart; resumed from "
          f"{Path(summary['resumed_from']).name}; finished {summary['steps']} steps")
    print("  what the launcher and the restarted workers said:")
    for line in killed.stderr.splitlines():  # (a surviving rank may also say its peer is gone first: timing)
        if "restarting the worker group" in line or line.strip().startswith("resumed from"):
            print("   ", line.strip().replace(f"{root}/", ""))
    a, b = losses(root / "straight" / "run"), losses(root / "killed" / "run")
    print(f"logged losses: {len(a)} vs {len(b)}, identical: {a == b}  (last {a[-1]:.6f} vs {b[-1]:.6f})")
    assert a == b, "the resumed run must log exactly the uninterrupted run's losses"

    # A snapshot whose file no longer matches its recorded checksum is refused, never loaded:
    snaps = sorted((root / "killed" / "snapshots").glob("step-*"))
    newest = snaps[-1]
    rank_file = newest / "rank-00000.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    again = train(root / "killed", "--resume", "auto")  # the same run: it redoes steps 21-24 from step 20
    assert again.returncode == 0, again.stderr
    print(f"after corrupting {newest.name}/rank-00000.pt, --resume auto says:")
    for line in again.stderr.splitlines():
        if "snapshot" in line.lower():
            print("   ", line.strip().replace(f"{root}/", ""))
    resumed = json.loads((root / "killed" / "run" / "summary.json").read_text())["resumed_from"]
    assert Path(resumed).name == snaps[-2].name, resumed
    print(f"and resumed from {Path(resumed).name} instead.")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as d:
            main(Path(d))
