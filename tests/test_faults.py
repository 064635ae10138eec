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


def test_a_sigterm_at_the_last_step_leaves_the_final_evaluation_to_the_resumed_run(run_cli, tmp_path):
    """The signal comes at the last step: the training is done, its final evaluation is left at its first batch
    (a stop ends an evaluation at once), the snapshot of step 6 and the summary say so and the launcher exits 0;
    `--resume auto` trains nothing more and evaluates, completing the run."""
    args = [*TRAIN, "--max-steps", "6", "--snapshot-dir", "s", "--out", "b"]
    proc = run_cli(*args, env={"DISTLAB_TERM_AGENT_AT_STEP": "1:6"})
    assert proc.returncode == 0, proc.stderr
    stopped = _summary(tmp_path / "b" / "summary.json")
    assert stopped["stopped"] == "preempted" and stopped["steps"] == 6 and stopped["evals"] == [], stopped
    assert stopped["snapshot"].endswith("step-00000006")
    run_cli(*args, "--resume", "auto", check=True)
    done = _summary(tmp_path / "b" / "summary.json")
    assert done["stopped"] == "completed" and [e["step"] for e in done["evals"]] == [6]


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


def test_a_stop_signal_during_an_evaluation_ends_it_at_once_and_the_resumed_run_evaluates_again(run_cli, tmp_path):
    """SIGTERM as step 4's evaluation begins (one window at a time of 3,000: an evaluation far longer than
    a scheduler's grace period): every rank leaves it at the next batch -- the run stops at step 4, snapshot and
    summary written, no evaluation of step 4 recorded (before, the whole evaluation ran first and the stop
    came steps later) -- and `--resume auto` finishes the run with its final evaluation."""
    args = ["train", "--nproc-per-node", "2", "--model", "gpt", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
            "--dataset", "synthetic-text:40000", "--block-size", "8", "--global-batch-size", "4", "--max-steps", "6",
            "--eval-every", "4", "--eval-batch-size", "1", "--no-progress", "--snapshot-dir", "s"]
    proc = run_cli(*args, "--out", "a", env={"DISTLAB_TERM_AGENT_AT_STEP": "0:4"})
    assert proc.returncode == 0, proc.stderr
    stopped = _summary(tmp_path / "a" / "summary.json")
    assert stopped["stopped"] == "preempted" and stopped["steps"] == 4, stopped
    assert [e["step"] for e in stopped["evals"]] == [], stopped["evals"]
    assert "preempted during the evaluation of step 4, which was left unfinished" in proc.stdout, proc.stdout
    proc = run_cli(*args, "--resume", "auto", "--out", "a", check=True)
    done = _summary(tmp_path / "a" / "summary.json")
    assert done["stopped"] == "completed" and done["steps"] == 6 and [e["step"] for e in done["evals"]] == [6]
