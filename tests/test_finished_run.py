"""A run that finished is never reported as failed, and a run that failed before its first step
leaves nothing that stops the fixed command from running: the real console script through real
torchrun, with faults placed from outside distlab (a ``sitecustomize`` in the workers)."""

import json
import textwrap

TRAIN = ["train", "--nproc-per-node", "2", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8",
         "--max-steps", "2", "--global-batch-size", "8", "--no-progress"]


def _abort_in_workers(tmp_path, rank: int, at_hard_exit: bool = False) -> dict:
    """An environment whose worker of global rank ``rank`` aborts (SIGABRT) in the interpreter's exit, as
    gloo's threads occasionally do in a finished process -- and, with ``at_hard_exit``, in ``os._exit``
    too (a worker that dies after its work whatever it does)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import atexit, os
        if os.environ.get("RANK") == "{rank}" and os.environ.get("TORCHELASTIC_RUN_ID"):
            atexit.register(os.abort)
            if {at_hard_exit}:
                os._exit = lambda code: os.abort()
    """))
    # a sitecustomize runs when an interpreter starts: the workers as fresh interpreters, not forked warm
    return {"PYTHONPATH": str(site), "DISTLAB_WORKER_START": "exec"}


def test_a_worker_that_would_abort_in_teardown_after_a_complete_run_exits_0(run_cli, tmp_path):
    proc = run_cli(*TRAIN, "--out", str(tmp_path / "run"), env=_abort_in_workers(tmp_path, 1))
    assert proc.returncode == 0, proc.stderr
    assert "workers failed" not in proc.stderr and "SIGABRT" not in proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped"] == "completed"


def test_a_worker_that_dies_after_the_run_finished_does_not_make_the_run_failed(run_cli, tmp_path):
    proc = run_cli(*TRAIN, "--out", str(tmp_path / "run"), env=_abort_in_workers(tmp_path, 1, at_hard_exit=True))
    assert proc.returncode == 0, proc.stderr
    assert "distlab: warning: rank 1 killed by SIGABRT after the run had finished (step 2" in proc.stderr
    assert "distlab: error" not in proc.stderr


FAILS_IN_ITS_FIRST_STEP = textwrap.dedent("""
    from torch import nn


    class Net(nn.Module):
        def __init__(self, fail):
            super().__init__()
            self.fail, self.head = fail, nn.Linear(64, 4)

        def forward(self, x):
            if self.fail and not x.is_meta:  # fits the data (the check before launch passes), fails for real
                raise RuntimeError("the model's own bug")
            return self.head(x.flatten(1))


    def build(fail=True):
        return Net(fail)
""")


def test_a_run_that_fails_before_its_first_step_leaves_nothing_in_the_way_of_the_fixed_command(run_cli, tmp_path):
    model = tmp_path / "net.py"
    model.write_text(FAILS_IN_ITS_FIRST_STEP)
    for nproc in (["--nproc-per-node", "2"],):  # the launcher's lock (RunState's own: the same release)
        out, snaps = tmp_path / f"run{len(nproc)}", tmp_path / f"snaps{len(nproc)}"
        own = TRAIN[len(["train", "--nproc-per-node", "2"]):]
        own = own[:own.index("--mlp-widths")] + own[own.index("--mlp-widths") + 2:]  # your model takes no MLP widths
        flags = [*own, "--model", f"{model}:build", "--out", str(out),
                 "--snapshot-dir", str(snaps), *nproc]
        failed = run_cli("train", *flags)
        assert failed.returncode != 0 and "the model's own bug" in failed.stderr, failed.stderr
        assert not out.exists() and not snaps.exists()  # what the failed run made is gone
        run_cli("train", *flags, "--model-arg", "fail=False", check=True)  # the fixed command, same directories
        assert json.loads((out / "summary.json").read_text())["stopped"] == "completed"


def test_report_lists_an_empty_run_directory_as_failed_before_the_first_step(tmp_path):
    from distlab.tools.report import collect
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "metrics.jsonl").write_text("")
    inputs = collect([str(tmp_path)])
    assert inputs.runs == [] and inputs.problems == [
        (str(tmp_path / "early"), "failed before the first step: no step logged, no summary")]


def test_the_command_runs_its_exit_handlers_but_no_interpreter_teardown(run_cli, tmp_path):
    """Whatever a library leaves to the interpreter's teardown (here: an object whose finaliser fails, as
    torch's rendezvous keep-alive thread sometimes does) adds nothing to a finished command's output;
    exit handlers (locks, temporary directories) still run."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import atexit, pathlib

        class LeftToTeardown:
            def __del__(self):
                raise RuntimeError("a finaliser failing at teardown")

        left = LeftToTeardown()
        atexit.register(lambda: pathlib.Path({str(tmp_path / "exit-handlers-ran")!r}).touch())
    """))
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                   "--no-progress", "--out", str(tmp_path / "run"), env={"PYTHONPATH": str(site)}, fresh=True)
    assert proc.returncode == 0 and "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr
    assert (tmp_path / "exit-handlers-ran").exists()


def _slow_rank_0_teardown(tmp_path) -> dict:
    """An environment whose rank 0 takes 5 s to leave its process group, so the other rank, having met
    the same error, exits first and torchrun's agent stops rank 0 before it has said anything."""
    site = tmp_path / "slow-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os
        if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RUN_ID"):
            import pathlib, time
            import torch.distributed as dist
            destroy = dist.destroy_process_group
            def slowly(*args, **kwargs):
                time.sleep(5)
                return destroy(*args, **kwargs)
            dist.destroy_process_group = slowly
            pathlib.Path({str(tmp_path / "rank-0-is-slow")!r}).touch()
    """))
    # a sitecustomize runs when an interpreter starts: the workers as fresh interpreters, not forked warm
    return {"PYTHONPATH": str(site), "DISTLAB_WORKER_START": "exec"}


def test_an_error_every_rank_meets_is_said_once_even_when_rank_0_is_stopped_before_it_could(run_cli, tmp_path):
    slow = _slow_rank_0_teardown(tmp_path)
    diverged = run_cli("train", "--dataset", "synthetic:1x8x8:4:2560", "--mlp-widths", "16", "--lr", "1e20",
                       "--nproc-per-node", "2", "--max-steps", "20", "--snapshot-dir", "s", "--snapshot-every", "10",
                       "--out", "r", "--no-progress", env=slow)
    assert diverged.returncode == 1, diverged.stderr
    assert diverged.stderr.count("distlab: error: training diverged at step 2") == 1, diverged.stderr
    assert diverged.stderr.count("\n") == 1, diverged.stderr
    # rank 0 is slow to leave (or stopped before it got there): this test's case, either way
    assert (tmp_path / "rank-0-is-slow").exists()
    (tmp_path / "rank-0-is-slow").unlink()
    first = [*TRAIN, "--snapshot-dir", "s2", "--out", "r2"]
    run_cli(*first, check=True)
    mismatch = run_cli(*first, "--resume", "auto", "--max-steps", "4", "--mlp-widths", "12", env=slow)
    assert mismatch.returncode == 2, mismatch.stderr
    assert mismatch.stderr.count("distlab: error:") == 1 and "12" in mismatch.stderr, mismatch.stderr
    assert (tmp_path / "rank-0-is-slow").exists()


def test_a_run_whose_final_model_cannot_be_written_keeps_its_summary_and_says_so_in_one_line(run_cli, tmp_path):
    """A language model's run without snapshots whose final model file cannot be written (here: larger than
    the process may write, RLIMIT_FSIZE -- as a full disk it fails at the write, after training) still
    writes its summary and metrics, marked as such, and ends with one line that says what failed, what was
    written and that no snapshot holds the model; it exits 1, never "its results are complete"."""
    import resource

    def small_files():  # (Python ignores SIGXFSZ: the write fails with EFBIG instead)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    out = tmp_path / "run"
    proc = run_cli("train", "--nproc-per-node", "2", "--model", "gpt", "--dataset", "synthetic-text:2000",
                   "--block-size", "16", "--global-batch-size", "8", "--max-steps", "3", "--no-progress",
                   "--out", str(out), preexec_fn=small_files)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("distlab: error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"final write failed: {out}/model.safetensors could not be written: File too large" in errors[0]
    assert "summary.json and metrics.jsonl were written; no snapshot holds its model" in errors[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "final_write_failed" and summary["steps"] == 3
    assert "File too large" in summary["final_write_error"] and not (out / "model.safetensors").exists()
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 1
