"""Per-rank timelines (--trace A:B): every rank's spans in Chrome's Trace Event Format, one clock."""

from __future__ import annotations

import json

import pytest

from distlab import runtime
from distlab.errors import ConfigError
from distlab.launch.spawn import run_ranks
from distlab.plan import timeline_analysis
from distlab.runtime import timeline
from distlab.runtime.device import load_stretch
from distlab.train import Trainer, TrainConfig
from tests.conftest import mlp_only
from tests.trace_format import complete_events

PLAN_RESULTS = __import__("pathlib").Path(__file__).resolve().parent.parent / "results" / "plan"


def _cfg(out, **kw):
    settings = dict(model="mlp", mlp_widths=(256, 128), dataset="synthetic:1x16x16:4:640", global_batch_size=64,
                    max_steps=4, epochs=1, lr=0.05, optimizer="sgd", seed=0, progress=False, verbose=False,
                    eval_every_epoch=False, out=str(out), trace="2:3")
    return TrainConfig.from_flags(**mlp_only({**settings, **kw}))


def _train(rank, world, cfg):
    return Trainer(cfg.validate(world), runtime.from_process_group()).fit()["trace"]


def _spans(path) -> list[dict]:
    """trace.json checked against the Trace Event Format (tests/trace_format.py: lanes, threads and the
    nesting rule); metadata names every rank."""
    trace = json.loads(path.read_text())
    spans = complete_events(trace)
    named = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert named == {(0, "rank 0"), (1, "rank 1")}
    return spans


def _overlaps(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


@pytest.mark.parametrize("method", ["bucketed", "gather-scatter"])
def test_a_traced_run_shows_each_ranks_spans_and_whether_communication_hides_behind_backward(tmp_path, method):
    """Steps 2-3 of a 2-rank run: both ranks' data, forward, backward and optimizer spans, two of each;
    the bucketed sync's all-reduces run while the backward still computes, gather-scatter's only after it."""
    record = run_ranks(_train, 2, _cfg(tmp_path, dp_sync=method, bucket_mb=0.05), timeout=120)[0]
    assert record["steps"] == [2, 3] and record["ranks"] == 2 and record["clock_residual_us"] >= 0
    spans = _spans(tmp_path / "trace.json")
    for rank in (0, 1):
        mine = [s for s in spans if s["pid"] == rank]
        for name in ("data", "forward", "backward", "gradient sync", "finite check", "optimizer step"):
            assert sum(s["name"] == name for s in mine) == 2, (rank, name)
        assert all(s["dur"] > 0 or s["cat"] != "compute" for s in mine)
        # each block of the MLP (Flatten, Linear+ReLU, Linear+ReLU, Linear) timed inside the step's forward
        # and backward -- the first Linear's backward too (fed the data, it ends with its weights'
        # gradients); the Flatten has nothing to differentiate
        blocks = sorted(s["name"] for s in mine if s["name"].startswith("net."))
        assert blocks == sorted([f"{b} forward" for b in ("net.0", "net.1-net.2", "net.3-net.4", "net.5")] * 2
                                + [f"{b} backward" for b in ("net.1-net.2", "net.3-net.4", "net.5")] * 2), blocks
        backward = [s for s in mine if s["name"] == "backward"]
        assert all(any(b["ts"] <= s["ts"] and s["ts"] + s["dur"] <= b["ts"] + b["dur"] for b in backward)
                   for s in mine if s["name"].endswith(" backward") and s["name"] != "backward")
        forward = [s for s in mine if s["name"] == "forward"]
        assert all(any(f["ts"] <= s["ts"] and s["ts"] + s["dur"] <= f["ts"] + f["dur"] for f in forward)
                   for s in mine if s["name"].endswith(" forward") and s["name"] != "forward")
        comm = [s for s in mine if s["cat"] == "communication"]
        backward = [s for s in mine if s["name"] == "backward"]
        hidden = [c for c in comm if any(_overlaps(c, b) for b in backward)]
        if method == "bucketed":
            assert len(comm) >= 2 * 3 and all(c["name"].startswith("bucket ") for c in comm)
            assert hidden, "no bucket's all-reduce overlapped a backward"
        else:
            assert [c["name"] for c in comm] == ["gather to rank 0, scatter the mean"] * 2 and not hidden
    # the summary's reading of the same spans; the report draws the run's Gantt chart
    assert (record["hidden_communication"] > 0) == (method == "bucketed")
    # gather-scatter's communication is all exposed; the bucketed one's may hide entirely (its last
    # bucket can finish while backward's own end still runs, on a loaded machine)
    exposed = record["exposed_communication_s_per_step"]
    assert record["hidden_communication"] <= 1 and (exposed >= 0 if method == "bucketed" else exposed > 0)
    from distlab.tools.report import write_report
    inputs = write_report([str(tmp_path)], tmp_path / "report.html", images=tmp_path / "img")
    page = (tmp_path / "report.html").read_text()
    assert "<h2>Timelines</h2>" in page and "rank 1" not in inputs.problems.__repr__()
    assert len(inputs.images) >= 2  # the loss curves and the timeline
    # plan validate compares the traced phases with the prediction's
    from distlab.plan.calibration import calibrate
    from distlab.plan.text import format_validation
    from distlab.plan.validate import summaries, validate
    rows = validate(calibrate([str(PLAN_RESULTS)]), [str(tmp_path)])
    assert len(rows) == 1 and rows[0]["measured_compute_s"] > 0
    assert rows[0]["measured_exposed_comm_s"] == pytest.approx(exposed)  # the summary's reading, per step
    assert "traced run, per step" in format_validation(rows, summaries(rows))


GPT = dict(model="gpt", dataset="synthetic-text:2000", n_layer=2, n_head=4, n_embd=32, block_size=16, global_batch_size=8,
           dp_sync="allreduce")


@pytest.mark.parametrize("layout", [
    dict(zero=2, bucket_mb=0.02), dict(zero=1, bucket_mb=0.02), dict(dp_sync="bucketed", bucket_mb=0.02),
    dict(GPT, cp=2), dict(GPT, cp=2, cp_style="ulysses"), dict(GPT, model="gpt-moe", ep=2),
    dict(GPT, pp=2, microbatches=4, pp_schedule="zb"), dict(GPT, pp=2, microbatches=4, pp_virtual=2),
], ids=lambda d: "+".join(f"{k}={v}" for k, v in d.items() if k not in GPT or d[k] != GPT[k]))
def test_every_traced_layout_writes_spans_that_nest_on_each_track(tmp_path, layout):
    """Several buckets' reduce-scatters in flight at once, context, expert and pipeline parallel: on
    every (rank, thread) of trace.json two spans nest or are disjoint (concurrent collectives go to a
    lane's further threads), and each rank's communication is all still there."""
    record = run_ranks(_train, 2, _cfg(tmp_path, **layout), timeout=120)[0]
    spans = _spans(tmp_path / "trace.json")
    for rank in (0, 1):
        assert any(s["pid"] == rank and s["cat"] in ("communication", "pipeline") for s in spans), rank
    assert record["ranks"] == 2


def test_recording_is_off_outside_the_traced_steps():
    assert not timeline.active()
    assert timeline.span("forward") is timeline.span("backward")  # one shared do-nothing context
    timeline.async_span("bucket 0", handle=None)  # returns before touching the handle
    rec = timeline.start(0)
    with timeline.span("forward", micro_batch=1):
        pass
    assert timeline.stop() is rec and [s[:2] for s in rec.spans] == [("forward", "compute")]
    assert rec.spans[0][4] == {"micro_batch": 1} and rec.spans[0][3] >= rec.spans[0][2]


@pytest.mark.parametrize("text,why", [("3", "give `out`"), ("a:b", "A:B"), ("0:2", "count from 1"), ("5:2", "A <= B")])
def test_unreadable_trace_steps_are_refused(text, why):
    with pytest.raises(ConfigError, match=why):
        TrainConfig.from_flags(trace=text, out=None if text == "3" else "run").validate(1)


def _pipeline(rank, world, cfg):
    trainer = Trainer(cfg.validate(world), runtime.from_process_group())
    record = trainer.fit()["trace"]
    a, b = cfg.trace_steps()
    own = trainer.engine.schedule.timings[a - 1:b]  # the stage's own bookkeeping of the same steps
    return record, sum(t["wait_s"] for t in own) / sum(t["step_s"] for t in own)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipelines_timeline_shows_every_micro_batch_and_its_measured_bubble(tmp_path, schedule):
    """2 stages, 4 micro-batches, steps 2-3: each stage's forwards and backwards of every micro-batch,
    named by stage and micro-batch; the waits for neighbours over the schedule's time agree with the
    stage's own measured bubble (the same waits, timed a few clock reads apart: within 0.05 on a quiet machine;
    on a busy one a rank descheduled between those reads widens the gap, so the bound stretches with the load
    as the suite's deadlines do)."""
    cfg = _cfg(tmp_path, mlp_widths=(64, 32, 16), pp=2, microbatches=4, pp_schedule=schedule, dp_sync="allreduce")
    stretch = load_stretch()
    results = run_ranks(_pipeline, 2, cfg, timeout=120)
    stretch = max(stretch, load_stretch())
    spans = _spans(tmp_path / "trace.json")
    for rank, (record, own) in enumerate(results):
        names = [s["name"] for s in spans if s["pid"] == rank]
        for kind in ("F", "B"):
            assert sorted(n for n in names if f" {kind} mb " in n) == \
                sorted(f"stage {rank} {kind} mb {m}" for m in range(4) for _ in range(2)), (rank, kind)
        assert any(n.startswith("wait for") for n in names)
        assert record["per_rank"][rank]["pipeline_wait_fraction"] == pytest.approx(own, abs=0.05 * stretch)


def test_zero3s_gathers_prefetches_and_reduce_scatters_are_on_the_timeline(tmp_path):
    """ZeRO-3 from its second step prefetches the next module's parameters while one computes; a forward
    that waits for a gather computes only around the wait (so its gathers are not counted as hidden)."""
    record = run_ranks(_train, 2, _cfg(tmp_path, zero=3), timeout=120)[0]
    spans = _spans(tmp_path / "trace.json")
    for rank in (0, 1):
        names = [s["name"] for s in spans if s["pid"] == rank]
        for kind in ("all-gather net.", "prefetch net.", "reduce-scatter net.", "wait for all-gather"):
            assert any(n.startswith(kind) for n in names), (rank, kind)
    blocking = [s for s in spans if s["cat"] == "communication" and s.get("args", {}).get("blocking")]
    assert blocking and all(s["name"].startswith("reduce-scatter") for s in blocking)  # ZeRO-3's per-module ones
    assert record["hidden_communication"] < 1


def _profiled(rank, world, cfg):
    return Trainer(cfg.validate(world), runtime.from_process_group()).fit()["profile"]


def test_profile_writes_each_ranks_torch_profiler_trace_with_distlabs_spans_among_the_operators(tmp_path):
    record = run_ranks(_profiled, 1, _cfg(tmp_path, trace=None, profile="2:2"), timeout=120)[0]
    assert record["steps"] == [2, 2] and record["ranks"] == 1
    events = json.loads((tmp_path / "profile" / "rank-00000.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer step"} <= names  # distlab's spans, once each (one step)
    assert any(str(n).startswith("aten::") for n in names)  # torch's operators
    assert not timeline.active() and not timeline._LABELS  # nothing left on after the profiled steps


def test_plan_draws_the_predicted_step_on_the_same_lanes(tmp_path):
    """plan --timeline: the predicted step as a trace (forward, backward, the gradient all-reduce) that
    ends where the predicted step does, and its Gantt chart."""
    from tests.conftest import invoke
    from distlab.plan.calibration import calibrate
    (tmp_path / "cal.json").write_text(calibrate([str(PLAN_RESULTS)]).to_json())
    code, out, err = invoke(["plan", "--model", "mlp", "--dataset", "synthetic:1x16x16:4:960", "--dp", "2",
                             "--dp-sync", "allreduce", "--calibration", "cal.json", "--timeline", "pred.json",
                             "--json", "pred-plan.json"], tmp_path)
    assert code == 0, err
    trace = json.loads((tmp_path / "pred.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {"forward", "backward"} <= {e["name"] for e in spans}
    assert any(e["cat"] == "communication" and e["name"].startswith("all-reduce") for e in spans)
    predicted = json.loads((tmp_path / "pred-plan.json").read_text())
    # the trace is the prediction's timeline, span for span, and that timeline ends where the step does
    assert sorted(e["name"] for e in spans) == sorted(s["name"] for s in predicted["timeline"])
    assert max(s["end_s"] for s in predicted["timeline"]) == predicted["step_s"]
    assert (tmp_path / "pred.png").stat().st_size > 0
    assert timeline_analysis.analyze(trace)["hidden_communication"] == 0.0  # per-parameter all-reduce: after backward


def test_tensor_parallel_collectives_say_which_block_they_belong_to(tmp_path):
    """TP+SP on the GPT: each block's all-gathers, reduce-scatters and all-reduces, forward and backward,
    carry the block's name (the embedding's and the head's, outside every block, carry none)."""
    cfg = _cfg(tmp_path, model="gpt", dataset="synthetic-text:2000", n_layer=2, n_head=4, n_embd=32, block_size=16,
               global_batch_size=8, tp=2, sequence_parallel=True, dp_sync="allreduce", trace="3:3")
    run_ranks(_train, 2, cfg, timeout=120)
    spans = [s for s in _spans(tmp_path / "trace.json") if s["cat"] == "communication"]
    for rank in (0, 1):
        by_block = {b: [s for s in spans if s["pid"] == rank and s.get("args", {}).get("block") == b]
                    for b in ("Block 1", "Block 2")}
        for block, mine in by_block.items():
            kinds = {s["name"].split()[0] + " " + s["name"].split()[1] for s in mine}
            assert kinds == {"tensor-parallel all-gather", "sequence-parallel reduce-scatter",
                             "tensor-parallel all-reduce"}, (rank, block, kinds)
            assert all(s["name"].endswith(f" in {block}") for s in mine)
            # forward and backward both: as many all-gathers as reduce-scatters (each undoes the other)
            assert sum("all-gather" in s["name"] for s in mine) == sum("reduce-scatter" in s["name"] for s in mine)


def test_steps_asked_past_the_runs_end_are_said_and_a_file_in_the_profiles_place_is_one_line(run_cli, tmp_path):
    base = ["train", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "8", "--max-steps", "4", "--no-progress"]
    proc = run_cli(*base, "--trace", "6:8", "--profile", "3:9", "--out", "run", check=True)
    assert "warning  --trace 6:8 starts after the run's last step (4): nothing will be traced" in proc.stdout
    assert "warning  --profile 3:9 ends after the run's last step (4): steps 3-4 are profiled" in proc.stdout
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "profile").write_text("a file of the user's")
    proc = run_cli(*base, "--profile", "2:2", "--out", "other")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "which is a file" in proc.stderr
    assert (tmp_path / "other" / "profile").read_text() == "a file of the user's"
