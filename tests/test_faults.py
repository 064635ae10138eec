"""Fault drills (``distlab verify --faults``): SIGKILL mid-epoch and while a snapshot is written,
preemption by SIGTERM, finishing on fewer processes, a full disk.

Every drill runs the real thing: torchrun's agent and its workers over gloo, real signals, real
files. Bitwise means every rank's final model and every logged loss are equal to an uninterrupted
run's: a resumed run replays exactly the float operations of an uninterrupted one.
"""

import json
import os
import shutil

TRAIN = ("train", "--dataset", "synthetic:1x8x8:4:2048", "--mlp-widths", "32,16", "--max-steps", "30",
         "--nproc-per-node", "2", "--no-progress", "--log-every", "5", "--optimizer", "adam", "--lr", "0.01")


def _summary(path):
    return json.loads(path.read_text())


def test_verify_faults_runs_every_drill_on_real_jobs(run_cli, tmp_path):
    # distlab verify --faults: an uninterrupted job, then the same job SIGKILLed mid-epoch, SIGKILLed while
    # writing a snapshot, preempted by SIGTERM (then --resume auto), preempted and finished on 1 process,
    # and with its snapshots on a full disk. 10 steps, snapshots every 2, faults after step 6.
    proc = run_cli("verify", "--faults", "--nproc", "2", "--workdir", "w", "--json", "r.json", timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    records = {r["drill"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert list(records) == ["kill", "kill-in-snapshot", "preempt", "reshard", "disk-full"]
    for drill in ("kill", "kill-in-snapshot", "preempt"):
        r = records[drill]
        assert r["passed"] and r["bitwise"] and r["max_abs_param_diff"] == 0 and r["max_loss_diff"] == 0, r
    # rank 1 died right after step 6, before that step's snapshot: the group went back to step 4's
    assert records["kill"]["restarts"] == 1 and records["kill"]["resumed_from"].endswith("step-00000004")
    # the snapshot of step 4 was never committed: the restarted group went back to step 2
    assert records["kill-in-snapshot"]["resumed_from"].endswith("step-00000002")
    assert "stopped at step" in records["preempt"]["detail"] and records["preempt"]["attempts"] == 2
    finished = _summary(tmp_path / "w" / "0-allreduce+adam" / "preempted" / "run" / "summary.json")
    assert finished["stopped"] == "completed" and [e["step"] for e in finished["layouts"]][0] == 0
    reshard = records["reshard"]
    assert reshard["passed"] and 0 <= reshard["max_abs_param_diff"] <= reshard["tolerance"] < 1e-4
    assert "2 ranks from step 0 -> 1 ranks from step" in reshard["detail"]
    disk = records["disk-full"]
    if os.geteuid() == 0 and shutil.which("mount"):
        assert disk["passed"], disk
        assert "No space left on device (errno 28)" in disk["detail"] and "is intact" in disk["detail"]
    else:
        assert disk["passed"] is None and "skipped" in disk["detail"]


def test_a_sigterm_as_the_run_finishes_leaves_its_results_complete_and_exits_0(run_cli, tmp_path):
    """The signal comes at the last step: the run had done all it was asked -- its summary says completed, and
    the launcher says so rather than calling it stopped before the workers had stopped cleanly."""
    proc = run_cli(*TRAIN, "--max-steps", "6", "--snapshot-dir", "s", "--out", "b",
                   env={"DISTLAB_TERM_AGENT_AT_STEP": "1:6"})
    assert proc.returncode == 0, proc.stderr
    assert _summary(tmp_path / "b" / "summary.json")["stopped"] == "completed"
    assert "SIGTERM came as the run finished (step 6, b/summary.json written): its results are complete" \
        in proc.stderr


def test_a_preempted_run_says_so_and_exits_0(run_cli, tmp_path):
    proc = run_cli(*TRAIN, "--max-steps", "12", "--snapshot-dir", "s", "--out", "b",
                   env={"DISTLAB_TERM_AGENT_AT_STEP": "1:4"})
    assert proc.returncode == 0, proc.stderr
    stopped = _summary(tmp_path / "b" / "summary.json")
    # stopped at an agreed step after the signal and before the end (how many steps the signal takes to
    # reach every rank depends on the machine's load, so no bound on that)
    assert stopped["stopped"] == "preempted" and 4 <= stopped["steps"] < 12
    assert stopped["snapshot"].endswith(f"step-{stopped['steps']:08d}")  # the preemption's own snapshot
    assert f"stopped by SIGTERM at step {stopped['steps']} as asked" in proc.stderr
    assert f"preempted (SIGTERM) at step {stopped['steps']}" in proc.stdout
    assert "--resume auto" in proc.stdout


def test_resume_is_the_kill_drill_and_cannot_be_combined_with_faults(run_cli):
    proc = run_cli("verify", "--resume", "--faults", "preempt")
    assert proc.returncode == 2 and "--resume is the kill drill of --faults: give one of them" in proc.stderr
    proc = run_cli("verify", "--faults", "flood")
    assert proc.returncode == 2 and "unknown fault drill 'flood'" in proc.stderr
