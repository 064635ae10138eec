"""Fault drills: preemption (SIGTERM), SIGKILL while a snapshot is written, a full disk.

Every drill runs the real thing: torchrun's agent and its workers over gloo, real signals, real
files. Bitwise means the final models (exported from the last snapshots) are equal element for
element: a resumed run replays exactly the float operations of an uninterrupted one.
"""

import contextlib
import json
import os
import shutil
import subprocess

import pytest
import torch

from distlab.train import snapshot as snap
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


@contextlib.contextmanager
def _small_tmpfs(path, size_bytes):
    """A tmpfs of ``size_bytes`` mounted at ``path`` (root only; the test skips with the reason otherwise)."""
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full disk is drilled on a small tmpfs, which needs root and mount(8)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_disk_fails_in_one_line_and_keeps_the_previous_snapshot(run_cli, tmp_path):
    run_cli(*TRAIN, "--max-steps", "4", "--snapshot-dir", "probe", "--out", "p", check=True)
    one = sum(f.stat().st_size for f in (tmp_path / "probe" / "step-00000004").iterdir())
    # room for the snapshot of step 4 and about half of the next one
    with _small_tmpfs(tmp_path / "disk", (int(1.5 * one) // 4096 + 1) * 4096) as disk:
        proc = run_cli(*TRAIN, "--snapshot-dir", str(disk), "--snapshot-every", "4", "--out", "b")
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "No space left on device (errno 28)" in errors[0], proc.stderr
        assert "the snapshot of step 8 could not be written" in errors[0]
        assert "the previous snapshot" in errors[0] and "step-00000004 is intact" in errors[0]
        assert [p.name for p in snap.snapshots(disk)] == ["step-00000004"]
        assert not [p for p in disk.iterdir() if p.name.startswith(".tmp-")]  # the partial one is gone
        meta = snap.read_meta(disk / "step-00000004")
        for r in range(2):
            snap.load_rank_file(disk / "step-00000004", meta, r)  # every checksum still matches
