"""``--tensorboard DIR``: event files TensorBoard's own reader loads, holding what metrics.jsonl holds
(loss, LR, throughput at the same steps), the evaluations and every rank's memory; refused before
launch, with the install line, where the package is missing."""

import json
import sys

import pytest
from tests.conftest import run_patiently

pytest.importorskip("tensorboard", reason="the tensorboard package is an optional extra (pip install tensorboard)")


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_event_files_hold_the_runs_numbers_at_its_steps(run_cli, tmp_path):
    run_cli("train", "--model", "mlp", "--mlp-widths", "8", "--dataset", "synthetic:1x4x4:3:240", "--max-steps", "6",
            "--global-batch-size", "12", "--log-every", "2", "--nproc-per-node", "2", "--tensorboard", "tb",
            "--out", "run", "--no-progress", check=True, timeout=240)
    scalars = _scalars(tmp_path / "tb")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in records] == [2, 4, 6]
    for (_, value), r in zip(scalars["train/loss"], records):
        assert value == pytest.approx(r["loss"], rel=1e-6)  # float32 in the event file
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([r["lr"] for r in records], rel=1e-6)
    assert "train/samples_per_s" in scalars
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert scalars["eval/test_accuracy"][-1] == (6, pytest.approx(summary["test_accuracy"], rel=1e-6))
    for rank in (0, 1):  # every rank's memory, gathered to rank 0
        assert all(v > 10 for _, v in scalars[f"memory/rank_{rank}_rss_mb"])
    assert "tensorboard" not in (tmp_path / "run" / "config.toml").read_text()  # where, not what


def test_a_missing_package_is_refused_before_launch_with_the_install_line():
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "from distlab.train.config import TrainConfig\n"
            "TrainConfig.from_flags(dataset='synthetic:1x4x4:3', tensorboard='tb').validate(1)\n")
    proc = run_patiently([sys.executable, "-c", code], 120)
    assert proc.returncode != 0 and "pip install tensorboard" in proc.stderr


def test_a_tensorboard_directory_in_use_by_another_run_is_refused(run_cli, tmp_path):
    from distlab.train import lock
    held = tmp_path / "tb"
    assert lock.hold(held, flag="tensorboard")  # this process stands for a run writing there
    try:
        for nproc in ([], ["--nproc-per-node", "2"]):
            proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                           "--no-progress", "--tensorboard", str(held), "--out", str(tmp_path / f"o{len(nproc)}"),
                           *nproc, fresh=True)  # a process of its own: this one holds the lock
            assert proc.returncode == 2 and f"--tensorboard {held} is in use by another run" in proc.stderr, proc.stderr
        assert [p.name for p in held.iterdir()] == [lock.NAME]  # no event file of the refused runs
    finally:
        lock.release(held)


def test_a_finished_runs_tensorboard_directory_is_not_written_by_a_new_run(run_cli, tmp_path):
    flags = ["train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--lr-schedule", "constant",
             "--max-steps", "2", "--no-progress", "--tensorboard", "tb", "--snapshot-dir", "s"]
    run_cli(*flags, "--out", "first", check=True)
    before = sorted(p.name for p in (tmp_path / "tb").iterdir())
    proc = run_cli(*flags[:-2], "--out", "second")  # a fresh run
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--tensorboard tb already holds another run's event files" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == before and not (tmp_path / "second").exists()
    run_cli(*flags[:-4], "--max-steps", "3", *flags[-4:], "--out", "first", "--resume", "auto", check=True)  # its own
