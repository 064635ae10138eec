"""Fault drills: preemption (SIGTERM), SIGKILL while a snapshot is written, a full disk.

Every drill runs the real thing: torchrun's agent and its workers over gloo, real signals, real
files. Bitwise means the final models (exported from the last snapshots) are equal element for
element: a resumed run replays exactly the float operations of an uninterrupted one.
"""

import json

import torch

from distlab.train.export import whole_state

TRAIN = ("train", "--dataset", "synthetic:1x8x8:4:2048", "--mlp-widths", "32,16", "--max-steps", "30",
         "--nproc-per-node", "2", "--no-progress", "--log-every", "5", "--optimizer", "adam", "--lr", "0.01")


def _summary(path):
    return json.loads(path.read_text())


def _same_model(a, b):
    (x, _), (y, _) = whole_state(a), whole_state(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_sigterm_stops_every_rank_at_one_step_with_a_snapshot_and_resume_auto_continues_bitwise(run_cli, tmp_path):
    run_cli(*TRAIN, "--snapshot-dir", "straight", "--out", "a", check=True)
    # rank 1 sends SIGTERM to torchrun's agent after step 8, as Slurm or Kubernetes would; the agent
    # passes it to both workers, which agree on a step, snapshot, summarise and exit 0
    proc = run_cli(*TRAIN, "--snapshot-dir", "s", "--snapshot-every", "100", "--out", "b",
                   env={"DISTLAB_TERM_AGENT_AT_STEP": "1:8"})
    assert proc.returncode == 0, proc.stderr
    stopped = _summary(tmp_path / "b" / "summary.json")
    assert stopped["stopped"] == "preempted" and 8 <= stopped["steps"] <= 10
    assert stopped["snapshot"].endswith(f"step-{stopped['steps']:08d}")  # the preemption's own snapshot
    assert f"stopped by SIGTERM at step {stopped['steps']} as asked" in proc.stderr
    assert f"preempted (SIGTERM) at step {stopped['steps']}" in proc.stdout
    run_cli(*TRAIN, "--snapshot-dir", "s", "--out", "b", "--resume", "auto", check=True)
    done = _summary(tmp_path / "b" / "summary.json")
    assert done["stopped"] == "completed" and done["steps"] == 30 and done["attempts"] == 2
    assert _same_model(tmp_path / "straight" / "step-00000030", tmp_path / "s" / "step-00000030")
