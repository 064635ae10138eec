"""Snapshots that do not stall training (--snapshot-async): the state copied to host memory at the step,
written on a thread of its own -- the same snapshot, bit for bit, as a synchronous one; a process killed
mid-write leaves the previous snapshot good and a resume from it finishes as the uninterrupted run."""

import json

import torch

from distlab.train import snapshot as snap
from distlab.train import snapshot_load as snap_load

FLAGS = ["train", "--dataset", "synthetic:1x8x8:4:512", "--mlp-widths", "32", "--global-batch-size", "16",
         "--lr-schedule", "constant", "--nproc-per-node", "2", "--no-progress", "--log-every", "1", "--max-steps", "8",
         "--snapshot-every", "2"]


def _model(path, rank):
    meta = snap.read_meta(path)
    return snap_load.load_rank_file(path, meta, rank)["model"]


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_asynchronous_snapshot_is_the_synchronous_one_and_a_kill_mid_write_keeps_the_previous(run_cli, tmp_path):
    run_cli(*FLAGS, "--snapshot-dir", "sync", "--out", "sync-run", check=True)
    # rank 1 killed on the writing thread after its file of step 6 is written, before the commit
    killed = run_cli(*FLAGS, "--snapshot-dir", "k", "--out", "k-run", "--snapshot-async",
                     env={"DISTLAB_KILL_IN_SNAPSHOT": "1:6"})
    assert killed.returncode != 0
    kept = [p.name for p in snap.snapshots(tmp_path / "k")]
    assert "step-00000006" not in kept and kept[0] == "step-00000004", kept
    snap_load.load_rank_file(tmp_path / "k" / "step-00000004", snap.read_meta(tmp_path / "k" / "step-00000004"), 1)
    run_cli(*FLAGS, "--snapshot-dir", "k", "--out", "k-run", "--snapshot-async", "--resume", "auto", check=True)
    assert _losses(tmp_path / "k-run") == _losses(tmp_path / "sync-run")
    summary = json.loads((tmp_path / "k-run" / "summary.json").read_text())
    assert summary["snapshot_async"] and summary["snapshot"] == "k/step-00000008"
    assert summary["snapshot_stall_s_median"] is not None
    # the snapshots the resumed run wrote in the background are, bit for bit, the synchronous run's
    for step in ("step-00000006", "step-00000008"):
        for rank in range(2):
            a, b = _model(tmp_path / "sync" / step, rank), _model(tmp_path / "k" / step, rank)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_asynchronous_snapshots_need_a_directory(refused_here):
    proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:64", "--snapshot-async")
    assert "--snapshot-async" in proc.stderr and "--snapshot-dir" in proc.stderr
