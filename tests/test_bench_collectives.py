"""distlab bench collectives through the real CLI: JSON contract, accuracy and byte fields."""

import json
from pathlib import Path

import pytest

from distlab.tools.verify import sgd_tolerance, sum_tolerance

RECORD_FIELDS = {"algorithm", "op", "world_size", "numel", "dtype", "time_s_median", "time_s_min", "time_s_max",
                 "algbw_gbps", "busbw_gbps", "max_abs_err", "rel_err", "peak_rss_mb", "bytes_sent_per_rank",
                 "tcp_loopback_gbps", "busbw_pct_of_tcp", "threads_per_rank", "cores"}


def test_bench_collectives_writes_the_contract(run_cli, tmp_path):
    out, plots = tmp_path / "bench", tmp_path / "plots"
    proc = run_cli("bench", "collectives", "--world", "1,3", "--sizes", "10,1e3", "--repeats", "3", "--warmup", "1",
                   "--runs", "2", "--out", str(out), "--plot", str(plots), timeout=300, check=True)
    records = json.loads((out / "collectives.json").read_text())
    assert len(records) == 2 * 2 * 5  # worlds x sizes x algorithms
    for r in records:
        assert RECORD_FIELDS <= r.keys()
        assert r["time_s_min"] <= r["time_s_median"] <= r["time_s_max"]
        assert r["runs"] == 2 and len(r["time_s_median_per_run"]) == 2  # median of the two runs' medians
        assert min(r["time_s_median_per_run"]) <= r["time_s_median"] <= max(r["time_s_median_per_run"])
        # inputs in [-1, 1] (float32): one reduction of world_size values in some order vs float64's
        assert r["max_abs_err"] <= sum_tolerance(r["world_size"], 1.0) and r["tcp_loopback_gbps"] > 0
    by = {(r["world_size"], r["numel"], r["algorithm"]): r for r in records}
    assert by[(1, 1000, "ring")]["bytes_sent_per_rank"] == 0
    # world 3, 1000 float32 = 4000 bytes: ring sends about 2(n-1)/n * S (chunks of 334, 333, 333)
    assert abs(by[(3, 1000, "ring")]["bytes_sent_per_rank"] - 2 * 2 * 4000 / 3) <= 8
    assert by[(3, 1000, "gather_scatter")]["bytes_sent_per_rank"] == 2 * 4000  # rank 0: (n-1) * S
    assert "world 3: ring faster than butterfly" in proc.stdout
    assert "busbw GB/s" in proc.stdout and (plots / "collectives_busbw_w3.png").stat().st_size > 1000
    # the alpha-beta model of each algorithm, fitted to these times: printed, written, plotted against them
    assert "alpha-beta fit of each all-reduce, t = alpha x message rounds + beta x bytes" in proc.stdout
    fitted = json.loads((out / "collectives-fit.json").read_text())["fits"]
    assert sorted(f["algorithm"] for f in fitted) == sorted({r["algorithm"] for r in records})
    assert all(f["world_size"] == 3 and f["points"] == 2 and f["alpha_s"] >= 0 for f in fitted)
    assert (plots / "collectives_fit_w3.png").stat().st_size > 1000


def test_the_alpha_beta_fit_recovers_the_model_that_made_the_times():
    """Times made by t = alpha x rounds + beta x bytes (the ring's on 4 ranks, the butterfly's) give back alpha and
    beta to float64 rounding of the 2x2 least-squares solve: within a few eps times its normal matrix's
    condition number."""
    from distlab.bench.collectives import fits
    from distlab.plan.machine import rounds, volume
    made = {"ring": (2e-4, 1e-9), "butterfly": (5e-4, 2e-9)}
    records = [{"algorithm": a, "numel": n, "world_size": 4, "op": "sum", "dtype": "float32",
                "time_s_median": alpha * rounds(a, 4) + beta * volume(a, 4, 4 * n)}
               for a, (alpha, beta) in made.items() for n in (10**3, 10**4, 10**5, 10**6)]
    import numpy as np
    eps = np.finfo(np.float64).eps
    for f in fits(records):
        a = f["algorithm"]
        alpha, beta = made[a]
        rows = np.array([(rounds(a, 4) / r["time_s_median"], volume(a, 4, 4 * r["numel"]) / r["time_s_median"])
                         for r in records if r["algorithm"] == a])
        bound = 8 * np.linalg.cond(rows.T @ rows) * eps  # the solve's forward error, relative
        assert abs(f["alpha_s"] - alpha) <= bound * alpha and abs(f["beta_s_per_byte"] - beta) <= bound * beta
        assert f["max_rel_err"] <= bound


def test_bench_rejects_bad_flags(run_cli):
    proc = run_cli("bench", "collectives", "--ops", "mean")
    assert proc.returncode == 2 and "unknown --ops value 'mean'" in proc.stderr


def test_crossover_is_the_size_from_which_ring_stays_faster():
    from distlab.bench.collectives import crossovers

    def rec(algo, numel, t, world=4):
        return {"algorithm": algo, "numel": numel, "time_s_median": t, "world_size": world, "op": "sum",
                "dtype": "float32"}
    records = [rec("butterfly", 1000, 1.0), rec("ring", 1000, 2.0), rec("butterfly", 10**4, 2.0),
               rec("ring", 10**4, 1.5), rec("butterfly", 10**5, 2.0), rec("ring", 10**5, 2.5),
               rec("butterfly", 10**6, 9.0), rec("ring", 10**6, 5.0),
               rec("butterfly", 1000, 1.0, world=2), rec("ring", 1000, 3.0, world=2)]
    # at 1e4 ring is faster but loses again at 1e5: the crossover is 1e6; world 2 never crosses
    assert crossovers(records) == {2: None, 4: 10**6}


def test_bench_syncbn_records_accuracy_time_and_memory(run_cli, tmp_path):
    proc = run_cli("bench", "syncbn", "--workers", "1,2", "--features", "8", "--batches", "8", "--repeats", "3",
                   "--warmup", "1", "--out", str(tmp_path), "--plot", str(tmp_path / "plots"), timeout=300, check=True)
    assert (tmp_path / "plots" / "syncbn_w2.png").stat().st_size > 1000
    records = json.loads((tmp_path / "syncbn.json").read_text())
    by = {(r["workers"], r["implementation"]): r for r in records}
    assert set(by) == {(w, i) for w in (1, 2) for i in ("distlab", "local", "torch")}
    assert not by[(2, "torch")]["available"] and "CUDA" in by[(2, "torch")]["reason"]  # CPU run
    local = by[(2, "local")]  # local statistics of 4 samples are not the batch's: far beyond rounding
    assert local["max_abs_out_diff"] > 10 * local["tolerance"] > 0
    for key in ((2, "distlab"), (1, "distlab"), (1, "local")):  # on one worker local is the whole batch
        r = by[key]
        assert max(r["max_abs_out_diff"], r["max_abs_grad_diff"]) <= r["tolerance"], r
    for key in ((1, "distlab"), (2, "distlab"), (2, "local")):
        r = by[key]
        assert r["time_s_median"] > 0 and r["saved_for_backward_bytes"] > 0 and r["cores"] >= 1
    assert "not available" in proc.stdout


def test_bench_dp_trains_each_method_and_compares_with_ddp(tmp_path, monkeypatch):
    import multiprocessing.util
    import tempfile

    from distlab.bench import dp
    from distlab.parallel import Strategy
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # multiprocessing keeps the first temporary directory it makes for the whole process, and a fork
    # server started later binds its socket there: make it in the real one, not in this (long) path
    multiprocessing.util.get_temp_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    dp.WORKLOADS["tiny"] = {"model": "mlp", "dataset": "synthetic:1x8x8:4:512", "fallback": None, "sync_bn": "off",
                            "lr": 0.05}
    try:
        records = dp.run(["tiny"], nproc=2, steps=6, batch=16,
                         methods=[Strategy.parse(m) for m in ("allreduce", "bucketed:ring", "ddp")],
                         out=tmp_path, progress=lambda s: None, trace=True)
    finally:
        del dp.WORKLOADS["tiny"]
    assert [(r["world_size"], r["dp_sync"], r["collective"]) for r in records] == [
        (1, None, None), (2, "allreduce", "native"), (2, "bucketed", "ring"), (2, "ddp", "native")]
    # --trace: each method's last two steps traced; the per-parameter all-reduce after backward hides nothing
    assert "hidden_communication" not in records[0] and records[1]["hidden_communication"] == 0.0
    assert all((tmp_path / "traces").joinpath(Path(r["trace_path"]).parent.name, "trace.json").is_file()
               for r in records[1:])
    assert dp.table(records).splitlines()[0].split()[-1] == "hidden"
    losses = [r["final_train_loss"] for r in records]
    # every method trains the same model the same way: two runs, each within verify's float32 bound
    assert max(losses) - min(losses) <= 2 * sgd_tolerance(6, 0.05, 16, momentum=0.9)
    assert records[0]["comm_bytes_per_step"] == 0
    # DDP (textbook volume) and the ring (counted messages) send the same 2(n-1)/n x gradient bytes
    assert records[3]["comm_bytes_per_step"] == records[2]["comm_bytes_per_step"] > 0
    assert json.loads((tmp_path / "dp.json").read_text())[1]["samples_per_s_median"] > 0
    assert "vs ddp" in dp.table(records)
    assert dp.plot(records, tmp_path / "plots")[0].stat().st_size > 1000
    assert not list(scratch.glob("distlab-*"))  # nothing of the bench's left in the temporary directory


def test_bench_parallel_smoke_runs_distlab_and_torch_side_by_side(run_cli, tmp_path):
    # The torch built-in loops (ZeroRedundancyOptimizer, FSDP2, DTensor TP) are exercised only here.
    proc = run_cli("bench", "parallel", "--workloads", "mlp", "--strategies",
                   "zero3,tp-megatron,torch-zero1,torch-fsdp2,torch-tp", "--nproc", "2", "--steps", "3",
                   "--batch", "16", "--dataset", "synthetic:1x28x28:10:256", "--optimizer", "sgd", "--out", "bp",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]  # see tests/test_spawn.py
    records = {r["strategy"]: r for r in json.loads((tmp_path / "bp" / "parallel.json").read_text())}
    assert set(records) == {"zero3", "tp-megatron", "torch-zero1", "torch-fsdp2", "torch-tp"}
    assert all(r["supported"] for r in records.values()), [r.get("error") for r in records.values()]
    # Same model, seed and batches: every strategy trains to the same loss, within verify's float32 bound (SGD)
    losses = [r["final_train_loss"] for r in records.values()]
    assert max(losses) - min(losses) <= 2 * sgd_tolerance(3, 0.05, 16, momentum=0.9)
    assert records["zero3"]["comm_bytes_per_step"] > 0 and "vs torch" in proc.stdout


def test_bench_parallel_puts_transformer_tensor_and_sequence_parallel_beside_dtensor(run_cli, tmp_path):
    proc = run_cli("bench", "parallel", "--workloads", "gpt", "--strategies", "tp-sp,torch-tp,torch-tp-sp",
                   "--nproc", "2", "--steps", "3", "--batch", "8", "--text-dataset", "synthetic-text",
                   "--optimizer", "sgd", "--out", "bp", timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = {r["strategy"]: r for r in json.loads((tmp_path / "bp" / "parallel.json").read_text())}
    assert set(records) == {"tp-sp", "torch-tp", "torch-tp-sp"}
    assert all(r["supported"] and r["model"] == "gpt" for r in records.values()), records
    # DTensor's plan computes the same model: the same losses, within verify's float32 bound (SGD)
    losses = [r["final_train_loss"] for r in records.values()]
    assert max(losses) - min(losses) <= 2 * sgd_tolerance(3, 0.05, 8 * 64, momentum=0.9)  # a mean over 8 x 64 tokens
    # the same collectives of the same activations: distlab's counted bytes equal torch's textbook volume
    assert records["tp-sp"]["comm_bytes_per_step"] == pytest.approx(records["torch-tp-sp"]["comm_bytes_per_step"],
                                                                    rel=0.05)


def test_bench_pipeline_runs_distlab_and_torch_pipelining_on_the_same_split(run_cli, tmp_path):
    proc = run_cli("bench", "pipeline", "--microbatches", "2", "--schedules", "gpipe,1f1b,interleaved", "--steps",
                   "3", "--batch", "8", "--implementations", "distlab,distlab-actions,torch", "--out", "bp", timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "bp" / "pipeline.json").read_text())
    assert {(r["schedule"], r["implementation"]) for r in records} == {
        ("gpipe", "distlab"), ("gpipe", "torch"), ("1f1b", "distlab"), ("1f1b", "torch"),
        ("interleaved", "distlab"), ("interleaved", "torch"), ("gpipe", "distlab-actions"), ("1f1b", "distlab-actions")}
    played = [r for r in records if r["implementation"] == "distlab-actions"]
    # the executor playing GPipe and 1F1B: the plain loops' losses to the last bit, timed beside them
    assert all(r["max_loss_diff_vs_plain"] == 0 and r["vs_plain"] > 0 for r in played) and len(played) == 2
    records = [r for r in records if r not in played]
    for r in records:
        # (P - 1) / (M + P - 1); interleaved with 2 chunks per rank: (P - 1) / (V M + P - 1)
        assert r["bubble_ideal"] == pytest.approx(1 / 5 if r["schedule"] == "interleaved" else 1 / 3)
        assert len(r["losses"]) == 3
        if r["implementation"] == "distlab":
            # the same model, seed, split and batches: torch's losses within verify's float32 bound (SGD lr 0.1,
            # no momentum, 3 steps, a mean over 8 sequences x 64 tokens)
            assert r["max_loss_diff_vs_torch"] <= 2 * sgd_tolerance(3, 0.1, 8 * 64)
            assert r["bytes_sent_per_stage"][0] > 0
            if r["schedule"] != "interleaved":
                assert r["microbatches_held_per_stage"] == ([2, 2] if r["schedule"] == "gpipe" else [2, 1])
            # peak activations, measured the same way for both: distlab's stages hold no more than torch's
            theirs = next(t for t in records if t["implementation"] == "torch" and t["schedule"] == r["schedule"])
            assert all(0 < a <= b for a, b in zip(r["activation_peak_bytes_per_stage"],
                                                  theirs["activation_peak_bytes_per_stage"]))
    assert "vs torch" in proc.stdout
    markdown = run_cli("bench", "markdown", "bp/pipeline.json", check=True).stdout
    assert markdown.startswith("| schedule | M |")


def test_bench_dp_sweeps_bucket_sizes_of_the_bucketed_methods():
    from distlab.bench import dp
    from distlab.parallel import Strategy
    methods = [Strategy.parse(m) for m in ("allreduce", "bucketed", "ddp")]
    swept = dp.with_buckets(methods, [1.0, 25.0])
    assert [str(m) for m in swept] == ["allreduce", "bucketed+bucket=1", "bucketed", "ddp+bucket=1", "ddp"]
    assert dp.with_buckets(methods, None) == methods

    def record(method, bucket, sps):
        name, _, collective = method.partition(":")
        return {"workload": "mlp", "world_size": 2, "dp_sync": name, "collective": collective or "native",
                "bucket_mb": bucket, "time_per_step_s_median": 64 / sps, "samples_per_s_median": sps,
                "comm_bytes_per_step": 0, "peak_rss_mb": 1, "final_train_loss": 1.0, "test_accuracy": None}
    rows = dp.rows([record("bucketed", 1.0, 150), record("bucketed", 25.0, 300), record("ddp", 1.0, 100),
                    record("ddp", 25.0, 200), record("allreduce", None, 100)])
    # each bucket size against DDP at the same size; other methods against DDP at its default size
    assert [(r["method"], r["vs_ddp"]) for r in rows] == [
        ("bucketed:native 1 MB", "1.50x"), ("bucketed:native 25 MB", "1.50x"), ("ddp:native 1 MB", "1.00x"),
        ("ddp:native 25 MB", "1.00x"), ("allreduce:native", "0.50x")]


def test_a_bench_on_a_busy_machine_says_so_and_a_fit_without_a_per_byte_cost_says_why(run_cli, tmp_path):
    """`bench collectives` where the load before it was 17 (on any core count here: the launch's reading) says,
    after its table, that its timings and the algorithms' order hold only beside a quiet machine's (it ranked
    gather/scatter fastest at load 17 without a word) and records the load; `plan calibrate` of times that did
    not grow with the bytes says the per-byte cost was not measured, not "0.000 ns/byte (inf GB/s)"."""
    out = tmp_path / "bench"
    proc = run_cli("bench", "collectives", "--world", "2", "--sizes", "10,1e3", "--algorithms", "ring,native",
                   "--repeats", "2", "--warmup", "1", "--out", str(out), timeout=300, check=True,
                   env={"DISTLAB_LOAD_AT_LAUNCH": "17"})
    assert "distlab: warning: the machine was busy before this bench (load 17.00 on" in proc.stderr, proc.stderr
    assert "which algorithm ranks first -- hold only against runs on an equally quiet machine" in proc.stderr
    assert "(the machine was busy: this run's fit only)" in proc.stdout, proc.stdout
    quiet = run_cli("bench", "collectives", "--world", "2", "--sizes", "10", "--algorithms", "native", "--repeats",
                    "2", "--warmup", "1", "--out", str(tmp_path / "quiet"), timeout=300, check=True)
    assert "distlab: warning" not in quiet.stderr, quiet.stderr
    records = json.loads((out / "collectives.json").read_text())
    for r in records:  # the same time at every size: nothing per byte to fit
        r["time_s_median"] = r["time_s_min"] = r["time_s_max"] = 1e-4
        r["time_s_median_per_run"] = [1e-4]
    (out / "collectives.json").write_text(json.dumps(records))
    proc = run_cli("plan", "calibrate", str(out / "collectives.json"), "-o", str(tmp_path / "cal.json"), check=True)
    assert "inf GB/s" not in proc.stdout and "beta not measured (the times did not grow with the bytes" in \
        proc.stdout, proc.stdout
