"""The real console script, in subprocesses, through real torchrun; outputs parsed as JSON."""

import json
import re
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from distlab.data.idx import write_idx
from tests.conftest import communicate_patiently

SUMMARY_FIELDS = {"world_size", "strategy", "model", "dataset", "global_batch_size", "steps", "epochs",
                  "final_train_loss", "test_accuracy", "test_loss", "time_per_step_s_median", "samples_per_s",
                  "peak_rss_mb", "peak_cuda_mb", "comm_bytes_per_step", "wall_time_s", "resumed_from"}
METRIC_FIELDS = {"step", "epoch", "loss", "lr", "samples_per_s", "time_s"}


def _one_line_error(proc, *needles):
    """Exit non-zero with exactly one stderr line 'distlab: error: ...' containing every needle."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("distlab: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_train_two_processes_writes_metrics_and_summary(run_cli, tmp_path):
    out, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    proc = run_cli("train", "--nproc-per-node", "2", "--model", "mlp", "--mlp-widths", "64",
                   "--dataset", "synthetic:1x8x8:4:512", "--global-batch-size", "32", "--epochs", "2",
                   "--log-every", "4", "--dp-sync", "ddp", "--out", str(out), check=True, env={"TMPDIR": str(scratch)})
    # The launch leaves nothing in the temporary directory (torchrun's log directories); torch's
    # compile cache (torchinductor_USER) is shared by every run on purpose.
    assert not [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_FIELDS <= summary.keys()
    assert summary["world_size"] == 2 and summary["launcher"] == "torchrun"
    assert summary["strategy"]["dp_sync"] == "ddp" and summary["local_batch_size"] == 16
    assert summary["steps"] == 2 * (512 // 32) and summary["epochs"] == 2
    assert 0 <= summary["test_accuracy"] <= 1 and summary["test_loss"] > 0
    assert summary["time_per_step_s_median"] > 0 and summary["peak_rss_mb"] > 0
    assert summary["peak_cuda_mb"] is None and summary["resumed_from"] is None
    n_params = summary["num_parameters"]
    assert summary["comm_bytes_per_step"] == 2 * (2 - 1) * 4 * n_params // 2  # 2(n-1)/n * S
    assert len(summary["evals"]) == 2 and summary["evals"][-1]["test_samples"] == 128
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(4, 33, 4))
    assert all(METRIC_FIELDS <= r.keys() for r in records)
    assert records[-1]["loss"] < records[0]["loss"]  # it learns
    assert proc.stdout.count("final train loss") == 1  # rank 0 printed the summary, once
    assert proc.stdout.count("eval step") == 2
    # The header, before the first step, says what runs: data and where from, strategy, mesh, batch.
    head = proc.stdout[:proc.stdout.index("step ")]
    assert "data     synthetic:1x8x8:4:512 from generated: 512 train, 128 test" in head
    from distlab.runtime import cores
    per_rank = max(1, cores() // 2)  # cores // local ranks
    assert f"strategy ddp on 2 processes x {per_rank} thread{'s' if per_rank > 1 else ''}" in head
    assert "mesh     dp 2: ranks 0-1 in one data-parallel group" in head
    assert "batch    32 global = 2 data-parallel rank(s) x 16; 32 steps, 16 per epoch" in head


def test_the_header_says_what_each_epoch_leaves_out_past_its_last_whole_global_batch(run_cli, tmp_path):
    """70 training samples at a global batch of 8 on 2 ranks: 8 steps an epoch, and the 6 samples past them are
    said (every step is a whole global batch); 64 samples leave none, and the header says nothing of it."""
    for n, words in ((70, "; each epoch leaves out 6 of its 70 training samples (the last, partial global batch"),
                     (64, None)):
        proc = run_cli("train", "--nproc-per-node", "2", "--model", "mlp", "--mlp-widths", "8", "--dataset",
                       f"synthetic:1x8x8:4:{n}", "--global-batch-size", "8", "--max-steps", "1", "--no-progress",
                       "--out", str(tmp_path / str(n)), check=True)
        head = proc.stdout[:proc.stdout.index("step ")]
        line = next(line for line in head.splitlines() if line.startswith("batch "))
        assert line.endswith("8 per epoch" if words is None else "others each epoch, as the order is shuffled)")
        assert words is None or words in line, line


def test_the_tensor_parallel_header_counts_a_tied_matrix_once(run_cli, tmp_path):
    """A checkpoint whose embedding is its LM head (Qwen2's small models) on --tp 2: the split layers hold every
    parameter of the rank but the RMSNorms' (2 per block and the last), the tied matrix counted once -- it was
    counted in both the embedding and the head, so the part was larger than the whole."""
    import re
    from tests.test_hf import _saved
    theirs = _saved("Qwen2ForCausalLM", tmp_path / "in", tie_word_embeddings=True)
    proc = run_cli("train", "--nproc-per-node", "2", "--tp", "2", "--init-from", f"hf:{tmp_path / 'in'}", "--dataset",
                   "synthetic-text:2000", "--block-size", "16", "--global-batch-size", "4", "--max-steps", "1",
                   "--no-progress", "--out", str(tmp_path / "run"), check=True)
    split, total = (int(n.replace(",", "")) for n in re.search(
        r"tensor parallel: .*?, ([\d,]+) of this rank's ([\d,]+) parameters", proc.stdout).groups())
    norms = theirs.config.hidden_size * (2 * theirs.config.num_hidden_layers + 1)
    assert split == total - norms, (split, total, norms)


def test_header_shows_the_tensor_parallel_mesh_and_what_is_split(run_cli, tmp_path):
    proc = run_cli("train", "--nproc-per-node", "4", "--tp", "2", "--model", "mlp-bn", "--mlp-widths", "16,8", "--dataset",
                   "synthetic:1x8x8:4:256", "--global-batch-size", "16", "--max-steps", "2", "--grad-accum", "2",
                   "--no-progress", "--out", str(tmp_path / "run"), check=True)
    assert "mesh     dp 2 x tp 2: TP groups [0, 1] [2, 3]; DP groups [0, 2] [1, 3]" in proc.stdout
    assert "(micro-batches of 4 x 2)" in proc.stdout
    split = next(line for line in proc.stdout.splitlines() if line.startswith("tensor parallel:"))
    assert "2 layers split (net.1, net.3)" in split and "the rest is replicated" in split  # BN and head are not
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mesh"]["layout"].startswith("dp 2 x tp 2") and summary["micro_batch_size"] == 4
    assert summary["num_parameters_per_rank"] < summary["num_parameters"]


def test_the_agent_gives_stopping_workers_time_for_their_snapshot(monkeypatch, tmp_path):
    """torchrun's agent SIGKILLs workers 30 s after passing SIGTERM/Ctrl-C on: a big model's stop
    snapshot needs longer. The launch gives them STOP_GRACE_S (the scheduler's own grace, or a second
    Ctrl-C, decides before that); a value the user set is kept."""
    import tempfile

    from torch.distributed.launcher.api import LaunchConfig

    from distlab.launch.torchrun import STOP_GRACE_S, LaunchOptions, agent_environment
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # torch's LaunchConfig makes a log directory there
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    env = agent_environment(LaunchOptions(nproc_per_node=2))
    assert STOP_GRACE_S >= 300 and env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(STOP_GRACE_S)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2)
    if hasattr(config, "shutdown_timeout"):  # torch reads it (2.13 on; older agents wait 30 s, fixed)
        assert config.shutdown_timeout == STOP_GRACE_S
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "45")
    assert agent_environment(LaunchOptions(nproc_per_node=2))["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "45"


def test_a_single_node_launch_takes_a_free_port_not_29500(run_cli, tmp_path):
    """torchrun's static rendezvous binds 29500 by default (torch before 2.12): two jobs on one host, or
    a test suite under pytest -n, collided. One node without --master-port rendezvous on a free port."""
    import socket

    from distlab.launch.torchrun import LaunchOptions, torchrun_args
    args = torchrun_args(LaunchOptions(nproc_per_node=2), ["train"])
    assert "--standalone" in args and "--master-port" not in args
    pinned = torchrun_args(LaunchOptions(nproc_per_node=2, master_port=6000), ["train"])
    assert "--standalone" not in pinned and pinned[pinned.index("--master-port") + 1] == "6000"
    holder = socket.socket()
    try:  # someone else's job on 29500 (if nothing else holds it already)
        holder.bind(("127.0.0.1", 29500))
        holder.listen()
    except OSError:
        pass
    try:
        run_cli("train", "--nproc-per-node", "2", "--dataset", "synthetic:1x8x8:4:256", "--global-batch-size", "16",
                "--max-steps", "2", "--no-progress", "--out", "run", check=True)
    finally:
        holder.close()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


def test_single_process_without_launcher(run_cli, tmp_path):
    out = tmp_path / "one"
    run_cli("train", "--dataset", "synthetic:1x8x8:4:256", "--global-batch-size", "32", "--max-steps", "5",
            "--out", str(out), check=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 5 and summary["launcher"] == "single"
    assert summary["comm_bytes_per_step"] == 0
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:256", "--max-steps", "1", "--no-progress", "--threads",
                   "1", check=True)
    head = proc.stdout.split("eval step")[0]
    assert "strategy single process" in head and "mesh" not in head
    assert "oversubscribed" not in head and summary["oversubscribed"] is False


def test_more_threads_than_cores_is_warned_in_the_header(run_cli, tmp_path):
    from distlab.runtime import cores
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:256", "--max-steps", "1", "--no-progress", "--threads",
                   str(cores() + 1), "--out", "over", check=True)
    head = proc.stdout.split("eval step")[0]
    assert f"1 rank x {cores() + 1} threads on this host = {cores() + 1} threads for {cores()} cores" in head
    assert "oversubscribed" in head and f"--threads {cores()}" in head
    assert json.loads((tmp_path / "over" / "summary.json").read_text())["oversubscribed"] is True


def test_an_explicit_data_dir_without_the_data_is_an_error_not_ignored(run_cli, tmp_path):
    system = tmp_path / "system" / "fashion-mnist"
    system.mkdir(parents=True)
    _write_fake_mnist(system)
    env = {"DISTLAB_SYSTEM_DATASETS": str(tmp_path / "system"), "DISTLAB_DATA": ""}
    proc = run_cli("train", "--data-dir", str(tmp_path / "typo"), "--max-steps", "1", env=env)
    _one_line_error(proc, f"--data-dir {tmp_path / 'typo'} does not exist", "would be used without --data-dir",
                    "synthetic:1x28x28:10:60000")
    proc = run_cli("train", "--max-steps", "1", "--global-batch-size", "4", "--no-progress", "--out", str(tmp_path / "run"),
                   env=env, check=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data_path"] == str(system) and f"from {system}" in proc.stdout
    proc = run_cli("train", "--dataset", "cifar10", "--data-dir", str(tmp_path), env=env)
    _one_line_error(proc, "cifar-10-batches-py", "--dataset synthetic:3x32x32:10:50000")


def test_manual_multi_node_style_start(run_cli, tmp_path):
    """Two 'nodes' each run one command with their own rank, meeting at tcp://127.0.0.1:PORT."""
    import subprocess
    from tests.conftest import distlab_exe

    from distlab.runtime import free_port
    port = str(free_port())
    out = tmp_path / "manual"
    args = ["train", "--dataset", "synthetic:1x8x8:4:256", "--global-batch-size", "32", "--max-steps", "4",
            "--num-nodes", "2", "--master-ip", "127.0.0.1", "--master-port", port, "--comm-timeout", "60",
            "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["DISTLAB_DEVICE"] = "cpu"  # both "nodes" share this host; on a GPU host they would share GPU 0
    procs = [subprocess.Popen([*distlab_exe(), *args, "--rank", str(r)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [communicate_patiently(p, 180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["launcher"] == "manual"
    assert outs[1][0].strip() == ""  # rank 1 is quiet


@pytest.mark.parametrize("world", [1, 2, 4])
def test_demo_ordered_print_is_exact(run_cli, world):
    proc = run_cli("demo", "ordered-print", "--nproc-per-node", str(world), check=True)
    assert proc.stdout == "".join(f"rank {r} of {world}\n" for r in range(world))


def test_demo_p2p(run_cli):
    proc = run_cli("demo", "p2p", "--nproc-per-node", "2", check=True)
    out = proc.stdout
    assert "rank 0: world size 2\nrank 1: world size 2\n" in out
    assert "rank 1: after blocking send/recv sum=12" in out and "rank 1: after isend/irecv sum=12" in out
    assert out.count("[18., 20., 22., 24.]") == 2  # 2 x [9..12] on both ranks


def test_demo_sampler(run_cli):
    proc = run_cli("demo", "sampler", "--nproc-per-node", "2", "--length", "8", "--batch-size", "2", check=True)
    assert "rank 0: items [0, 20, 40, 60] in batches [[0, 20], [40, 60]]" in proc.stdout
    assert "rank 1: items [10, 30, 50, 70] in batches [[10, 30], [50, 70]]" in proc.stdout
    assert "batch size 4: [[0, 10, 20, 30], [40, 50, 60, 70]]" in proc.stdout


def test_doctor(run_cli):
    proc = run_cli("doctor", check=True)
    assert "torch " in proc.stdout and "gloo yes" in proc.stdout and "cores:" in proc.stdout


# --------------------------------------------------------------------------- bad input


def test_batch_not_divisible_by_world_size(run_cli):
    proc = run_cli("train", "--nproc-per-node", "2", "--dataset", "synthetic:1x8x8:4", "--global-batch-size", "33")
    _one_line_error(proc, "--global-batch-size 33 is not divisible by world size 2")
    assert proc.returncode == 2


def test_unknown_model_and_dataset(run_cli):
    _one_line_error(run_cli("train", "--model", "vgg13", "--dataset", "synthetic:1x8x8:4"), "unknown model 'vgg13'")
    _one_line_error(run_cli("train", "--nproc-per-node", "2", "--dataset", "imagenet"), "unknown dataset 'imagenet'")


def test_missing_dataset_names_package_and_paths(run_cli, tmp_path):
    env = {"DISTLAB_SYSTEM_DATASETS": str(tmp_path / "nothing-here"), "DISTLAB_DATA": ""}
    proc = run_cli("train", "--nproc-per-node", "2", "--data-dir", str(tmp_path / "mine"), env=env)
    _one_line_error(proc, "dataset-fashion-mnist", str(tmp_path / "mine"), "synthetic:1x28x28:10:60000")


def test_port_already_in_use(run_cli):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        proc = run_cli("train", "--nproc-per-node", "2", "--dataset", "synthetic:1x8x8:4", "--master-port", port)
        _one_line_error(proc, f"port {port}", "already in use", "--master-port")
        proc = run_cli("train", "--dataset", "synthetic:1x8x8:4", "--rank", "0", "--world-size", "2",
                       "--master-addr", "127.0.0.1", "--master-port", port, "--comm-timeout", "5")
        _one_line_error(proc, f"port {port}", "already in use")


def test_missing_peer_in_manual_start_fails_within_timeout(run_cli):
    from distlab.runtime import free_port
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4", "--rank", "0", "--world-size", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--comm-timeout", "3",
                   timeout=60)
    _one_line_error(proc, "only 1 of 2 ranks joined")


def test_conflicting_launch_flags(run_cli):
    proc = run_cli("train", "--nproc-per-node", "2", "--rank", "0", "--world-size", "2")
    _one_line_error(proc, "cannot be combined")


def _write_fake_mnist(d: Path, n: int = 8) -> None:
    """Four small IDX files in Fashion-MNIST's layout (all-zero images, labels 0-9)."""
    for prefix in ("train", "t10k"):
        write_idx(d / f"{prefix}-images-idx3-ubyte.gz", np.zeros((n, 28, 28), np.uint8))
        write_idx(d / f"{prefix}-labels-idx1-ubyte.gz", (np.arange(n) % 10).astype(np.uint8))


def test_corrupt_dataset_file_is_a_clear_error(run_cli, tmp_path):
    d = tmp_path / "fashion-mnist"
    d.mkdir()
    _write_fake_mnist(d)
    Path(d / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    proc = run_cli("train", "--data-dir", str(tmp_path), "--global-batch-size", "2")
    _one_line_error(proc, "train-images-idx3-ubyte.gz")


def test_only_rank0_reports_shared_config_errors_but_every_rank_reports_its_own(monkeypatch, capsys):
    from distlab.cli import _report_error
    from distlab.errors import ConfigError, RankConfigError
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    _report_error(ConfigError("same on every rank"))
    _report_error(RankConfigError("local rank 1 has no GPU"))
    err = capsys.readouterr().err
    assert err == "distlab: error: [rank 1] local rank 1 has no GPU\n"


def test_verify_reports_every_strategy_against_single_process(run_cli, tmp_path):
    out = tmp_path / "verify.json"
    proc = run_cli("verify", "--nproc", "3", "--strategy", "bucketed:butterfly", "--strategy", "ddp+accum=4",
                   "--strategy", "allreduce:ring+syncbn", "--steps", "5", "--json", str(out), timeout=300, check=True)
    records = json.loads(out.read_text())
    assert [r["strategy"] for r in records] == ["bucketed:butterfly", "ddp+accum=4", "allreduce:ring+syncbn"]
    for r in records:
        assert {"strategy", "world_size", "steps", "max_abs_param_diff", "max_rel_param_diff", "max_loss_diff",
                "tolerance", "passed"} <= r.keys()
        assert r["world_size"] == 3 and r["steps"] == 5 and r["passed"]
        assert 0 < r["tolerance"] < 1e-4 and r["max_abs_param_diff"] <= r["tolerance"]
    assert records[2]["flags"] == {"dp_sync": "allreduce", "collective": "ring", "bucket_mb": 25.0, "grad_accum": 1,
                                   "sync_bn": "distlab", "find_unused": False, "tp": 1, "tp_style": None,
                                   "sequence_parallel": False, "zero": 0, "pp": 1, "microbatches": 1,
                                   "pp_schedule": None, "pp_balance": None, "activation_checkpointing": False,
                                   "ac_every": 1, "ac_policy": "block",
                                   "precision": "fp32", "reduce_dtype": None, "grad_compression": "none",
                                   "optimizer": "sgd"}
    assert "PASS" in proc.stdout and "FAIL" not in proc.stdout
    assert records[0]["torch_version"] and records[0]["host"] and records[0]["date"]  # where it ran, for reports


def test_verify_rejects_unreadable_strategies(refused_here, run_cli):
    proc = refused_here("verify", "--strategy", "bucketed:tree")
    assert proc.returncode == 2 and "unknown --collective 'tree'" in proc.stderr
    proc = refused_here("verify", "--strategy", "ddp+accum=5", "--nproc", "2")
    assert proc.returncode == 2 and "must split into --grad-accum 5" in proc.stderr


def test_verify_comparison_catches_a_difference():
    import torch

    from distlab.tools.verify import compare, config_for, parse_strategy, reference_run, tolerance
    cfg = config_for(parse_strategy("allreduce"), 2, steps=3)
    params, losses = reference_run(cfg)
    assert compare(params, losses, params, losses)["max_abs_param_diff"] == 0.0
    nudged = [p + (1e-3 if i == 0 else 0.0) for i, p in enumerate(params)]  # one parameter off by 1e-3
    diffs = compare(nudged, losses, params, losses)
    assert abs(diffs["max_abs_param_diff"] - 1e-3) < 1e-6 and diffs["max_abs_param_diff"] > tolerance(cfg)
    assert torch.is_tensor(params[0])


def test_sync_bn_torch_on_cpu_is_refused_before_launch(run_cli):
    proc = run_cli("train", "--nproc-per-node", "2", "--model", "small-cnn-bn", "--dataset", "synthetic:3x8x8:4:64",
                   "--sync-bn", "torch")
    error = _one_line_error(proc, "--sync-bn torch uses torch.nn.SyncBatchNorm, which only runs on GPUs",
                       "use --sync-bn distlab")
    assert proc.returncode == 2, error


def test_bench_markdown_renders_every_bench_json_the_repository_holds(run_cli):
    """Every JSON file under results/ but a run's own summary.json is one distlab wrote -- a bench, a
    verify, the main job's -- and each becomes a table."""
    root = Path(__file__).resolve().parents[1] / "results"
    files = sorted(p for p in root.rglob("*.json") if p.name != "summary.json")
    kinds = {p.name for p in files}
    assert {"collectives.json", "scaling.json", "parallel.json", "compression.json", "elastic.json", "overhead.json",
            "results.json", "snapshot-format.json", "checkpointing.json", "pipeline.json", "dp.json"} <= kinds, kinds
    proc = run_cli("bench", "markdown", *map(str, files), check=True)
    tables = [t for t in proc.stdout.split("\n\n") if t.strip()]
    assert len(tables) == len(files)
    for table in tables:
        lines = table.strip().splitlines()
        assert lines[0].startswith("| ") and set(lines[1]) <= set("|-") and len(lines) >= 3
        rows = [line for line in lines if line.startswith("|")]  # a footnote may follow
        cells = [len(re.findall(r"(?<!\\)\|", line)) for line in rows]  # a cell's own "|" is escaped
        assert len(rows) >= 3 and len(set(cells)) == 1, table


def test_a_worker_killed_mid_run_is_reported_by_rank_signal_step_and_snapshot(run_cli, tmp_path):
    # Rank 1 SIGKILLs itself right after step 5 (no restarts): one line names it, the signal, the last
    # logged step and how to go on from the newest snapshot; nobody printed anything else to see.
    proc = run_cli("train", "--nproc-per-node", "2", "--dataset", "synthetic:1x8x8:4:512", "--mlp-widths", "16",
                   "--global-batch-size", "16", "--max-steps", "20", "--log-every", "2", "--snapshot-every", "2",
                   "--snapshot-dir", "snaps", "--out", "run", "--no-progress", "--comm-timeout", "20",
                   env={"DISTLAB_KILL_AT_STEP": "1:5"}, timeout=120)
    assert proc.returncode != 0
    line = next(line for line in proc.stderr.splitlines() if "workers failed" in line)
    assert "rank 1 killed by SIGKILL first" in line and "last logged step 4" in line
    assert "snapshots in snaps (newest step-00000004): rerun the same command with --resume auto" in line


def test_failure_report_says_messages_are_above_only_when_a_worker_printed_one():
    import signal

    from distlab.launch.torchrun import failure_report
    killed = failure_report({0: (-signal.SIGTERM, 2.0), 1: (-signal.SIGKILL, 1.0)}, ["train"])
    assert killed == "workers failed: rank 1 killed by SIGKILL first; torchrun then stopped rank 0"
    failed = failure_report({0: (1, 1.0), 1: (-signal.SIGTERM, 2.0)}, ["train", "--snapshot-dir", "/nonexistent"])
    assert "rank 0 exit code 1 first" in failed and "their own messages are above" in failed
    assert "no snapshot in /nonexistent yet" in failed


def test_an_unavailable_backend_is_refused_once_before_launch(run_cli):
    proc = run_cli("train", "--nproc-per-node", "2", "--backend", "mpi", "--dataset", "synthetic:1x8x8:4")
    _one_line_error(proc, "no MPI backend", "--backend gloo")
    assert proc.returncode == 2 and "workers failed" not in proc.stderr


def test_zero_from_the_command_line_uses_its_documented_default_collective(run_cli, tmp_path):
    # The flag's default used to be read after Strategy had resolved it for no ZeRO: native, not auto.
    run_cli("train", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "16", "--max-steps", "2", "--zero", "2",
            "--nproc-per-node", "2", "--out", "z", "--no-progress", check=True)
    run_cli("train", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "16", "--max-steps", "2",
            "--nproc-per-node", "2", "--out", "dp", "--no-progress", check=True)
    collective = {d: json.loads((tmp_path / d / "summary.json").read_text())["strategy"]["collective"] for d in ("z", "dp")}
    assert collective == {"z": "auto", "dp": "native"}
    help_text = run_cli("train", "--help").stdout
    assert "auto (per collective, the one measured fastest)" in " ".join(help_text.split())


def _run_on_a_ticking_clock(rank, world, out):
    """A run whose Trainer reads a clock that moves one second per reading: every step and every
    evaluation lasts exactly one second, however loaded the machine is."""
    import types

    import distlab.train.clock as clock_module
    import distlab.train.trainer as trainer_module
    from distlab import runtime
    from distlab.train import TrainConfig, Trainer
    ticks = iter(range(1 << 30))
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    trainer_module.time = clock_module.time = clock  # the loop's and the step timer's clock
    cfg = TrainConfig.from_flags(dataset="synthetic:1x8x8:4:128", mlp_widths=(16,), global_batch_size=64, epochs=16,
                                 log_every=8, out=out, progress=False, verbose=False)
    summary = Trainer(cfg, runtime.from_process_group()).fit()
    return summary["samples_per_s"], summary["time_per_step_s_median"]


def test_logged_throughput_counts_only_training_time_when_a_window_spans_evaluations(tmp_path):
    # 2 steps per epoch, an evaluation after each, a log line every 8 steps: each window spans 4
    # evaluations. Timed from the last evaluation, a window counted 8 steps in the time of 2 (4x).
    from distlab.launch.spawn import run_ranks
    [(samples_per_s, median)] = run_ranks(_run_on_a_ticking_clock, 1, str(tmp_path / "r"), timeout=120)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert median == 1.0 and samples_per_s == 64.0
    assert [r["samples_per_s"] for r in records] == [64.0] * 4  # 8 steps of 64 samples in 8 seconds


def test_settings_that_do_nothing_are_refused_or_warned_never_labelled_active(refused_here, run_cli, tmp_path):
    proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                   "--sync-bn", "distlab", "--nproc-per-node", "2")
    assert proc.returncode == 2 and "--sync-bn distlab: model mlp has no BatchNorm layer" in proc.stderr
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                   "--zero", "3", "--out", "z", "--no-progress", check=True)
    assert "warning  zero 3: one data-parallel rank, so nothing is sharded" in proc.stdout
    assert json.loads((tmp_path / "z" / "summary.json").read_text())["inactive"][0].startswith("zero 3:")
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8,8", "--max-steps", "1",
                   "--tp", "2", "--nproc-per-node", "2", "--dp-sync", "allreduce", "--out", "t", "--no-progress",
                   check=True)
    assert "warning  dp_sync allreduce: one data-parallel rank, no gradient to synchronise" in proc.stdout
    # The default method on one data-parallel rank: no warning, and no method in the run's label.
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8,8", "--max-steps", "1",
                   "--tp", "2", "--nproc-per-node", "2", "--out", "t2", "--no-progress", check=True)
    assert "warning" not in proc.stdout and "strategy tp=2 on 2 processes" in proc.stdout, proc.stdout
    summary = json.loads((tmp_path / "t2" / "summary.json").read_text())
    assert summary["inactive"] == [] and summary["strategy_label"] == "tp=2"
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                   "--nproc-per-node", "2", "--out", "d", "--no-progress", check=True)
    assert "warning" not in proc.stdout and json.loads((tmp_path / "d" / "summary.json").read_text())["inactive"] == []


def test_the_header_states_zeros_memory_exactly_and_says_when_it_costs_more_than_data_parallel(run_cli, tmp_path):
    args = ("train", "--dataset", "synthetic:1x28x28:10:512", "--max-steps", "2", "--nproc-per-node", "2",
            "--no-progress")
    zero = run_cli(*args, "--zero", "1", "--out", "z", check=True).stdout
    assert "state    2.04 MiB of parameters + 1.02 MiB of the strategy's own copies" in zero  # 535,818 x 4 bytes
    peak = json.loads((tmp_path / "z" / "summary.json").read_text())["model_state_bytes_per_rank"] / 2**20
    assert f"holds more than plain data parallel would ({peak:.2f} vs 6.13 MiB predicted)" in zero
    adam = run_cli(*args, "--zero", "1", "--optimizer", "adam", "--out", "a", check=True).stdout
    assert "holds more than plain data parallel" not in adam  # Adam's two moments: sharding them pays off


def test_a_restart_says_at_once_who_died_of_what_where_and_what_the_group_resumes_from(run_cli, tmp_path):
    proc = run_cli("train", "--nproc-per-node", "2", "--dataset", "synthetic:1x8x8:4:512", "--mlp-widths", "16",
                   "--global-batch-size", "16", "--max-steps", "8", "--log-every", "1", "--snapshot-every", "2",
                   "--snapshot-dir", "snaps", "--out", "run", "--no-progress", "--max-restarts", "2",
                   env={"DISTLAB_KILL_AT_STEP": "1:5"}, timeout=180)
    assert proc.returncode == 0, proc.stderr
    line = next((line for line in proc.stderr.splitlines() if "restarting the worker group" in line), proc.stderr)
    assert re.search(r"^distlab: rank 1 \(pid \d+\) killed by SIGKILL after step [45] \(the last logged\); restarting "
                     r"the worker group \(restart 1 of 2\), resuming from the newest good snapshot in snaps "
                     r"\(step-00000004\)$", line), line
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["resumed_from"].endswith("step-00000004")


def test_a_malformed_or_unknown_master_address_is_one_line_before_any_wait(refused_here):
    """A manual start (`--num-nodes 2 --rank 1 --master-ip ...`): an address that is no IPv4 address or no host
    is said at once -- it waited out the whole rendezvous timeout, then said "could not reach" it."""
    for address, message in (("127.0.0.1000", "--master-addr '127.0.0.1000' is not an IPv4 address"),
                             ("10.0.0", "--master-addr '10.0.0' is not an IPv4 address"),
                             ("no-such-host.invalid", "--master-addr 'no-such-host.invalid': no such host")):
        proc = refused_here("train", "--num-nodes", "2", "--rank", "1", "--master-ip", address, "--master-port",
                            "29999", "--max-steps", "1")
        assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
