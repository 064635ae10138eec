"""Every layout `verify` checks is one `distlab plan` predicts, draws and validates: the predicted step
as a timeline in the trace format (a pipeline's stages each playing its schedule), and a run that went
exactly as predicted validates with no error -- its bubble, compute and exposed communication included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distlab.data import dataset_shape
from distlab.plan import Layout, calibrate, predict
from distlab.plan.machine import Link
from distlab.plan.text import format_validation
from distlab.plan.trace import trace
from distlab.plan.validate import summaries, validate
from distlab.plan import timeline_analysis
from distlab.runtime import trace_file
from distlab.tools.verify import config_for, default_strategies, planned
from tests.trace_format import complete_events

RESULTS = Path(__file__).resolve().parent.parent / "results" / "plan"
WORLD = 4
CASES = [c for c in default_strategies(WORLD) if planned(c.strategy)]  # (the plain ones: refused, below)


@pytest.fixture(scope="module")
def calibration():
    return calibrate([str(RESULTS)])


def _summary(cfg, lay: Layout, p: dict, found: dict, shape, classes) -> dict:
    """What a run's summary.json says of itself, had every step taken the predicted time."""
    return {"world_size": lay.world, "model": cfg.model, "dataset": cfg.dataset, "input_shape": list(shape),
            "num_classes": classes, "strategy": cfg.strategy.to_dict(), "optimizer": cfg.optimizer,
            "config": {"momentum": cfg.momentum, **cfg.options.to_dict(), "lora": cfg.to_dict()["lora"],
                       "group_size": cfg.group_size},
            "global_batch_size": cfg.global_batch_size, "local_batch_size": cfg.global_batch_size // lay.dp,
            "time_per_step_s_median": p["step_s"], "model_state_bytes_per_rank": p["model_state_bytes_per_rank"],
            "trace": {"per_rank": found["ranks"], **{k: found[k] for k in (
                "hidden_communication", "exposed_communication_s_per_step", "pipeline_wait_fraction")}}}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_verified_layout_is_predicted_drawn_and_validated(case, calibration, tmp_path):
    cfg = config_for(case, WORLD, steps=2)
    shape, classes = dataset_shape(cfg.dataset, cfg.block_size)
    t = trace(cfg.model, shape, classes, options=cfg.options, lora=cfg.lora)
    strategy = cfg.strategy
    lay = Layout(dp=strategy.dp_size(WORLD), strategy=strategy, optimizer=cfg.optimizer, momentum=cfg.momentum,
                 global_batch=cfg.global_batch_size, pairs=cfg.dataset.startswith("synthetic-pairs"),
                 group=cfg.group_size if cfg.reward else 1)  # GRPO: the update's rows, each prompt's completions
    p = predict(t, lay, Link(), calibration)
    drawn = trace_file.predicted_trace(p["timeline"], str(strategy))
    spans = complete_events(drawn)  # the trace format's rules, nesting on every thread included
    # a stage per pipeline rank, each with every micro-batch's forward and backward; the step ends with the prediction
    assert {e["pid"] for e in spans} == set(range(strategy.pp))
    assert max(s["end_s"] for s in p["timeline"]) == pytest.approx(p["step_s"], rel=1e-12)
    found = timeline_analysis.analyze(drawn)
    if strategy.pp > 1:
        per_stage = strategy.microbatches * strategy.pp_virtual
        for s in range(strategy.pp):
            assert sum(e["pid"] == s and " F mb " in e["name"] for e in spans) == per_stage
        # the trace holds whole nanoseconds: each wait's two ends and the schedule's end truncated by < 1 ns
        waits = [e for e in spans if e["cat"] == "pipeline"]
        schedule_s = min(e["dur"] for e in waits if e["name"] == trace_file.SCHEDULE) / 1e6
        bound = 3 * len(waits) * 1e-9 / schedule_s
        assert found["pipeline_wait_fraction"] == pytest.approx(p["pipeline"]["bubble_ideal"], abs=bound)
    from distlab.tools.plots import pyplot
    from distlab.tools.report.timelines import gantt
    fig = gantt(drawn, f"predicted: {strategy}")
    assert "one step" in fig.axes[0].get_title()
    pyplot().close(fig)
    # validated against a run that took exactly the predicted time, traced
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(_summary(cfg, lay, p, found, shape, classes)))
    rows = validate(calibration, [str(tmp_path)], world_min=1)
    assert len(rows) == 1 and rows[0]["time_rel_err"] == pytest.approx(0.0, abs=1e-9)
    assert rows[0]["measured_model_state_bytes"] == rows[0]["predicted_model_state_bytes"]
    if strategy.pp > 1:
        assert rows[0]["measured_bubble"] == pytest.approx(rows[0]["predicted_bubble"], abs=bound)
    text = format_validation(rows, summaries(rows))
    assert "traced run, per step" in text and "median |error| 0.0%" in text


def _traced(rank, world, cfg):
    from distlab import runtime
    from distlab.train import Trainer
    return Trainer(cfg.validate(world), runtime.from_process_group()).fit()["trace"]


def test_a_traced_pipeline_run_validates_and_its_layout_draws_per_stage(calibration, tmp_path):
    """The real thing on the CLI: a 2-stage GPT run traced over steps 3-4, then `plan validate` (table and
    --json, the measured bubble beside the predicted one) and `plan --timeline` of the same layout (a
    process per stage, each with every micro-batch)."""
    from distlab.launch.spawn import run_ranks
    from distlab.train import TrainConfig
    from tests.conftest import invoke
    cfg = TrainConfig.from_flags(model="gpt", dataset="synthetic-text:2000", n_layer=2, n_head=2, n_embd=16,
                                 block_size=8, global_batch_size=8, pp=2, microbatches=4, max_steps=4, trace="3:4",
                                 progress=False, verbose=False, eval_every_epoch=False, out=str(tmp_path / "run"))
    record = run_ranks(_traced, 2, cfg, timeout=120)[0]
    assert record["pipeline_wait_fraction"] is not None
    (tmp_path / "cal.json").write_text(calibration.to_json())
    code, out, err = invoke(["plan", "validate", "run", "--calibration", "cal.json", "--min-world", "1",
                             "--target", "100", "--json", "rows.json"], tmp_path)
    assert code == 0 and "Traceback" not in err, err
    rows = json.loads((tmp_path / "rows.json").read_text())["runs"]
    assert rows[0]["measured_bubble"] == pytest.approx(record["pipeline_wait_fraction"])
    assert rows[0]["predicted_bubble"] == pytest.approx(1 / 5)  # (P - 1) / (M + P - 1)
    assert "bubble" in out and f"{rows[0]['predicted_bubble']:.1%}" in out
    code, out, err = invoke(["plan", "--model", "gpt", "--dataset", "synthetic-text:2000", "--n-layer", "2",
                             "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--global-batch-size", "8",
                             "--pp", "2", "--microbatches", "4", "--calibration", "cal.json",
                             "--timeline", "pred.json"], tmp_path)
    assert code == 0, err
    spans = complete_events(json.loads((tmp_path / "pred.json").read_text()))
    for stage in (0, 1):
        assert sorted(e["name"] for e in spans if e["pid"] == stage and " mb " in e["name"]) == \
            sorted(f"stage {stage} {k} mb {m}" for k in "FB" for m in range(4))
    assert (tmp_path / "pred.png").stat().st_size > 0
