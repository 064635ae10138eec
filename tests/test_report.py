"""``distlab report``: a real run directory and bench/verify files in, one self-contained HTML page out;
bad inputs are listed, never fatal."""

import base64
import json
import re
import shutil
import subprocess

import pytest

from distlab.tools.report import bench_kind, collect


def _collectives():
    return [{"algorithm": algo, "op": "sum", "world_size": 2, "numel": n, "dtype": "float32",
             "time_s_median": t * n, "time_s_min": t * n, "time_s_max": t * n, "algbw_gbps": 1.0, "busbw_gbps": 1.0,
             "max_abs_err": 0.0, "rel_err": 0.0, "peak_rss_mb": 300.0, "bytes_sent_per_rank": 4 * n,
             "torch_version": "2.13.0+cpu", "host": "testhost", "cores": 2, "date": "2026-11-23T00:00:00+00:00"}
            for algo, t in (("native", 1e-9), ("ring", 2e-9)) for n in (1000, 100000)]


def _verify():
    return [{"strategy": "allreduce", "world_size": 2, "steps": 3, "max_abs_param_diff": 1e-8,
             "max_rel_param_diff": 1e-7, "max_loss_diff": 0.0, "tolerance": 1e-5, "passed": True}]


def test_report_names_every_input_and_lists_bad_ones(run_cli, tmp_path):
    run_cli("train", "--dataset", "synthetic:1x8x8:4:512", "--max-steps", "12", "--log-every", "3",
            "--no-progress", "--out", "run1", check=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "collectives.json").write_text(json.dumps(_collectives()))
    (tmp_path / "verify.json").write_text(json.dumps(_verify()))
    (tmp_path / "broken.json").write_text("[{not json")
    (tmp_path / "foreign.json").write_text(json.dumps({"hello": 1}))
    lacking = [{k: v for k, v in r.items() if k != "time_s_median"} for r in _collectives()]
    (tmp_path / "lacking.json").write_text(json.dumps(lacking))
    proc = run_cli("report", "run1", "bench", "verify.json", "broken.json", "foreign.json", "lacking.json",
                   "missing-dir", "-o", "out/report.html")
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    for name in ("run1", "bench/collectives.json", "verify.json"):
        assert f"<td>{name}</td>" in page  # listed as a used input
    problems = page.split("Inputs that could not be used")[1]
    for name in ("broken.json", "foreign.json", "lacking.json", "missing-dir"):
        assert name in problems and f"{name}:" in proc.stderr
    assert "not valid JSON" in problems and "does not exist" in problems and "lack a field" in problems
    # Plots are embedded PNGs: loss curves + evaluations (12 steps: an epoch of 8 and the end) + accuracy + the
    # final model's mistakes for the run, time/busbw for world size 2.
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 5 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    # headers say what and in which unit; cells are human numbers
    assert "<th>bus bandwidth (GB/s)</th>" in page and "<th>test accuracy</th>" in page and "<th>passed</th>" in page
    assert "<th>time (ms, median)</th>" in page and "<td>391 KiB</td>" in page and "<td>100,000</td>" in page
    assert "<th>time_s_median</th>" not in page and "<th>bytes_sent_per_rank</th>" not in page
    assert "2.13.0+cpu" in page and "testhost" in page  # machine and torch version per bench input
    assert "src=\"http" not in page and "<script" not in page  # self-contained


def test_kinds_are_recognised():
    assert bench_kind(_collectives()) == "collectives" and bench_kind(_verify()) == "verify"
    assert bench_kind([{"mode": "weak", "scaling_efficiency": 1.0}]) == "scaling"
    assert bench_kind([]) is None and bench_kind({"a": 1}) is None


def test_a_directory_without_inputs_is_reported(tmp_path):
    (tmp_path / "empty").mkdir()
    inputs = collect([str(tmp_path / "empty")])
    assert inputs.problems == [(str(tmp_path / "empty"), "no runs or bench files found in it")]


def test_snapshots_and_other_json_in_a_searched_directory_are_skipped_quietly(run_cli, tmp_path):
    """A directory with a run, its snapshots (meta.json) and a calibration: the run is used, the two
    JSON files distlab did not write as report input are counted, not listed as problems."""
    run_cli("train", "--dataset", "synthetic:1x8x8:4:512", "--max-steps", "6", "--no-progress", "--out", "all/run",
            "--snapshot-dir", "all/snaps", "--snapshot-every", "3", check=True)
    (tmp_path / "all" / "calibration.json").write_text(json.dumps({"collectives": {}}))
    (tmp_path / "all" / "collectives.json").write_text("[{broken")  # a bench file's name: never quiet
    proc = run_cli("report", "all", "-o", "r.html")
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "r.html").read_text()
    assert "<td>all/run</td>" in page
    assert "step-0000" not in page and "all/calibration.json" not in page
    assert "3 other JSON file(s) in the directories searched were skipped" in page  # 2 snapshots + calibration
    assert "3 other JSON file(s) skipped" in proc.stderr and "meta.json" not in proc.stderr
    assert "collectives.json: not valid JSON" in proc.stderr


def test_verify_records_say_where_they_ran_and_old_ones_say_nothing(tmp_path):
    from distlab.tools.report import write_report
    (tmp_path / "old.json").write_text(json.dumps(_verify()))
    (tmp_path / "new.json").write_text(json.dumps([{**_verify()[0], "torch_version": "2.13.0+cpu", "host": "h1",
                                                    "cores": 2, "date": "2026-11-23T10:00:00+00:00"}]))
    write_report([str(tmp_path / "old.json"), str(tmp_path / "new.json")], tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "not recorded" not in page and "torch 2.13.0+cpu, host h1, 2 cores" in page
    assert "<td>1.0e-08</td>" in page  # the parameter difference, in scientific notation


def test_lines_that_coincide_stay_apart_and_worker_axes_have_integer_ticks():
    from distlab.tools.plots import integer_ticks, pyplot, style
    plt = pyplot()
    fig, ax = plt.subplots()
    for i in range(3):  # three runs with identical losses
        ax.plot(range(50), [1.0 / (k + 1) for k in range(50)], **style(i, 50))
    kinds = {(line.get_linestyle(), line.get_marker(), str(line.get_markevery())) for line in ax.lines}
    assert len(kinds) == 3
    integer_ticks(ax, [1, 2, 4, 2])
    assert list(ax.get_xticks()) == [1, 2, 4]
    plt.close(fig)


CHROMIUM = next((shutil.which(c) for c in ("chromium", "chromium-browser", "google-chrome") if shutil.which(c)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here to render the page headless")
def test_report_of_every_committed_result_fits_a_1280_px_window(tmp_path):
    """The widest inputs there are -- every JSON and run under results/ (scaling tables, plan
    validation, parallel, collectives, three training runs) -- in a 1280-px window: nothing wider
    than the window, and the screenshot is a real page, not blank."""
    from pathlib import Path

    from distlab.tools.report import write_report
    results = Path(__file__).resolve().parent.parent / "results"
    inputs = write_report([str(results)], tmp_path / "r.html")
    assert {"run", "collectives", "parallel", "scaling"} <= {k for _, k in inputs.read} and not inputs.problems
    page = (tmp_path / "r.html").read_text()
    # measure in a copy (the report itself has no scripts): the page's width as the browser lays it out
    probe = page.replace("</body>", "<script>document.title = 'W' + document.documentElement.scrollWidth + 'x' "
                                    "+ document.documentElement.clientWidth;</script></body>")
    (tmp_path / "probe.html").write_text(probe)
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,900"]
    dom = subprocess.run([*browser, "--dump-dom", f"file://{tmp_path / 'probe.html'}"], capture_output=True,
                         text=True, timeout=120).stdout
    width = re.search(r"<title>W(\d+)x(\d+)</title>", dom)
    assert width, dom[:500]
    assert int(width.group(1)) <= int(width.group(2)) <= 1280, f"page is {width.group(1)} px wide in a 1280-px window"
    shot = tmp_path / "shot.png"
    subprocess.run([*browser, f"--screenshot={shot}", f"file://{tmp_path / 'r.html'}"], capture_output=True,
                   timeout=120)
    from PIL import Image  # noqa: PLC0415 - matplotlib brings pillow
    image = Image.open(shot)
    assert image.size[0] == 1280
    pixels = image.convert("L").getextrema()
    assert pixels[0] < 128 < pixels[1]  # dark text/lines on a light page: not blank


def test_a_plan_search_gets_where_each_layouts_step_goes_and_why_the_first_wins(run_cli, tmp_path):
    """`plan --search --json` is a report input: each ranked layout's step split into compute, recomputation,
    pipeline bubble and exposed communication, its memory against the GPU's, the table and the search's why."""
    run_cli("plan", "--model", "llama", "--n-layer", "4", "--n-embd", "64", "--n-head", "4", "--block-size", "64",
            "--machine", "h100-sxm", "--gpus", "8", "--precision", "bf16", "--global-batch-size", "32", "--search",
            "--top", "6", "--json", "s.json", check=True)
    result = json.loads((tmp_path / "s.json").read_text())
    proc = run_cli("report", "s.json", "-o", "r.html", check=True)
    page = (tmp_path / "r.html").read_text()
    assert "<td>s.json</td><td>search</td>" in page and "Inputs that could not be used" not in page, proc.stderr
    section = page.split("Layouts of a GPU cluster (distlab plan --search)")[1]
    assert f"8 x h100-sxm (1 node): {result['tried']} layouts tried, {result['fit']} fit" in section
    first = result["ranked"][0]["strategy_text"]
    assert section.count("<tr>") == 1 + len(result["ranked"]) and f"<td>{first}</td>" in section
    assert result["why"].splitlines()[0].split(" predicts ")[0] in section  # the why, as the search said it
    images = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([^"]+)"', section)
    assert len(images) == 1 and "seconds per step" in images[0][0] and "GiB per GPU" in images[0][0]


def test_plan_validation_gets_its_plot_and_images_are_written(tmp_path):
    """`plan validate --json` output is a report input: a predicted-vs-measured plot and its table;
    --images writes every plot as a PNG file too."""
    from distlab.tools.report import write_report
    rows = [{"run": f"r{i}", "world_size": 2, "link": "1gbit", "dp_sync": "ddp", "zero": 0, "measured_step_s": t,
             "predicted_step_s": t * 1.1, "time_rel_err": 0.1, "predicted_compute_s": 0.001,
             "predicted_exposed_comm_s": t, "measured_model_state_bytes": 10, "predicted_model_state_bytes": 10}
            for i, t in enumerate((0.01, 0.02))]
    path = tmp_path / "validate.json"
    path.write_text(json.dumps({"kind": "distlab-plan-validation", "summary": {}, "runs": rows}))
    inputs = write_report([str(path)], tmp_path / "r.html", images=tmp_path / "img")
    page = (tmp_path / "r.html").read_text()
    assert inputs.read == [(str(path), "plan")] and not inputs.problems
    assert "Cost model" in page and "<td>r1</td>" in page and "<th>predicted (ms)</th>" in page
    assert "<td>+10.0%</td>" in page and "<td>22</td>" in page  # error, predicted ms
    assert [p.name for p in inputs.images] == ["01-distlab-plan--predicted-vs-measured--med.png"]
    assert inputs.images[0].read_bytes()[:4] == b"\x89PNG"


def test_plan_sweep_gets_memory_and_fit_plot(tmp_path):
    from distlab.parallel import Strategy
    from distlab.plan import Layout, Link, generic_trace, sweep
    from distlab.tools.report import write_report
    rows = sweep(generic_trace(10**9, 0.0, 8), Layout(dp=8, optimizer="adam"), [8, 64], Link(), None, 8 * 2**30,
                 [Strategy(), Strategy(zero=3)])
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(rows))
    inputs = write_report([str(path)], tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert inputs.read == [(str(path), "sweep")] and not inputs.problems
    assert "Plan sweep" in page and "<td>zero=3</td>" in page and page.count("data:image/png") == 1


def test_report_survives_anything_it_scans(run_cli, tmp_path):
    run_cli("train", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "16", "--max-steps", "4", "--no-progress",
            "--out", "runs/good", check=True)
    good = json.loads((tmp_path / "runs" / "good" / "summary.json").read_text())
    for name, change in (("inf-accuracy", {"test_accuracy": float("inf")}), ("text-accuracy", {"test_accuracy": "high"}),
                         ("text-strategy", {"strategy": "zero"}), ("text-world", {"world_size": "two"})):
        (tmp_path / "runs" / name).mkdir()
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps({**good, **change}))
    nested = "[" * 100_000 + "]" * 100_000
    (tmp_path / "runs" / "deep").mkdir()
    (tmp_path / "runs" / "deep" / "summary.json").write_text(nested)
    (tmp_path / "runs" / "collectives.json").write_text(nested)  # a bench file's name: must be usable
    (tmp_path / "runs" / "notes.json").write_text(nested)
    bad_bench = _collectives()
    bad_bench[0]["time_s_median"] = "slow"
    (tmp_path / "runs" / "bench").mkdir()
    (tmp_path / "runs" / "bench" / "collectives.json").write_text(json.dumps(bad_bench))
    proc = run_cli("report", "runs", "-o", "report.html")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    page = (tmp_path / "report.html").read_text()
    for name in ("inf-accuracy", "text-accuracy", "text-strategy", "text-world", "deep", "collectives.json",
                 "bench/collectives.json"):
        assert f"runs/{name}" in proc.stderr and f"runs/{name}" in page, name  # listed at the top, not fatal
    assert "runs/good" in page and page.index("could not be used") < page.index("Training runs")
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    for args, message in ((("-o", "adir"), "-o adir is a directory"), (("--images", "afile"), "--images afile is a file")):
        proc = run_cli("report", "runs", *args)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_runs_are_grouped_by_data_set_and_a_classifier_shows_its_mistakes(run_cli, tmp_path):
    """A language model's nats/token and a classifier's loss never share axes: a section per data set
    (units in titles and headers); a classifier's final confusion matrix and misclassified images come
    from its predictions.npz, which agrees with its accuracy."""
    import numpy as np
    for name, data in (("img-a", "synthetic:1x4x4:3:240"), ("img-b", "synthetic:1x4x4:3:240"),
                       ("other", "synthetic:1x6x6:2:120")):
        run_cli("train", "--mlp-widths", "8", "--dataset", data, "--max-steps", "4", "--global-batch-size", "12",
                "--no-progress", "--out", name, check=True)
    run_cli("train", "--model", "gpt", "--dataset", "synthetic-text:2000", "--n-layer", "1", "--n-embd", "16",
            "--n-head", "2", "--block-size", "16", "--max-steps", "3", "--global-batch-size", "8", "--no-progress",
            "--out", "text", check=True)
    summary = json.loads((tmp_path / "img-a" / "summary.json").read_text())
    with np.load(tmp_path / "img-a" / summary["predictions"], allow_pickle=False) as f:
        confusion, labels, predictions = f["confusion"], f["labels"], f["predictions"]
        from distlab.data import load_dataset
        assert confusion.shape == (3, 3) and confusion.sum() == len(load_dataset("synthetic:1x4x4:3:240", "test"))
        assert np.trace(confusion) / confusion.sum() == pytest.approx(summary["test_accuracy"])
        assert len(labels) == min(36, confusion.sum() - np.trace(confusion)) and (labels != predictions).all()
        assert f["images"].shape == (len(labels), 1, 4, 4)
    assert "predictions" not in json.loads((tmp_path / "text" / "summary.json").read_text())  # a language model
    proc = run_cli("report", ".", "-o", "r.html", "--images", "png", check=True)
    page = (tmp_path / "r.html").read_text()
    heads = re.findall(r"<h2>Training runs: ([^<]+)</h2>", page)
    assert heads == ["synthetic-text:2000 &mdash; next-token prediction", "synthetic:1x4x4:3:240 &mdash; "
                     "classification", "synthetic:1x6x6:2:120 &mdash; classification"]
    text_part = page.split("synthetic-text:2000 &mdash;")[1].split("<h2>")[0]
    assert "<th>test loss (nats/token)</th>" in text_part and "img-a" not in text_part
    # one per section: the most accurate classifier's mistakes (the page stays short)
    assert page.count("what the final model gets wrong") == 2 and proc.returncode == 0
    # every picture says in words what it shows: its titles and axes (a confusion matrix's cells: counts)
    alts = re.findall(r'<img alt="([^"]*)"', page)
    assert alts and all(a not in ("", "plot", "a plot") for a in alts), alts
    assert any("loss vs step (training loss" in a and "against step" in a for a in alts)
    assert any("confusion" in a and "counts" in a for a in alts)
    names = sorted(p.name for p in (tmp_path / "png").iterdir())
    assert sum("confusion" in n for n in names) == 2 and any("synthetic-text-2000" in n and "loss-vs-step" in n
                                                            for n in names)
    # A damaged predictions.npz in one run: that file is named and skipped, every other run drawn.
    best = max(("img-a", "img-b"), key=lambda n: json.loads((tmp_path / n / "summary.json").read_text())["test_accuracy"])
    (tmp_path / best / "predictions.npz").write_bytes(b"PK\x03\x04 not a zip")
    from distlab.tools.report import render
    inputs = collect([str(tmp_path)])
    page = render(inputs)
    assert [p for p, _ in inputs.problems] == [str(tmp_path / best / "predictions.npz")], inputs.problems
    assert page.count("what the final model gets wrong") == 2  # the other image run's, in its place
    assert len(re.findall(r"<h2>Training runs: ", page)) == 3 and "runs could not be drawn" not in page


def test_run_tables_label_layouts_as_they_ran_and_bars_start_at_zero(tmp_path):
    """A single process is "single process", not its unused sync method; losses share one format; an
    accuracy bar's length is its accuracy (the axis starts at 0)."""
    from distlab.tools.report import runs as sections
    runs = []
    for name, acc, loss, world, strategy in (("one", 0.82, 4.192e-07, 1, {"dp_sync": "bucketed"}),
                                              ("two", 0.88, 0.0, 2, {"dp_sync": "bucketed", "pp": 2})):
        runs.append({"path": str(tmp_path / name), "metrics": [], "summary": {
            "dataset": "d", "world_size": world, "strategy": strategy, "test_accuracy": acc, "test_loss": loss,
            "steps": 3}})
    captured = {}
    real = sections.png

    def keep(fig):
        captured.setdefault("xlim", fig.axes[0].get_xlim())
        return real(fig)
    sections.png = keep
    try:
        html = sections._runs_section("d", runs, [])
    finally:
        sections.png = real
    assert captured["xlim"][0] == 0.0
    cells = re.findall(r"<td>([^<]*)</td>", html)
    assert "single process" in cells and "bucketed" not in cells and "pp=2+mb=2+1f1b" in cells
    assert "0.0000" in cells and not any("e-07" in c for c in cells)


def test_predictions_are_kept_only_for_a_classifier_of_the_data_sets_classes():
    """A model with more outputs than the data set has classes (a user's, say) evaluates as before and
    keeps no confusion matrix (its predictions could name classes the data set does not have)."""
    import torch
    from torch import nn

    from distlab.data import load_dataset
    from distlab.parallel import Strategy, build_mesh, parallelize
    from distlab.train.evaluate import evaluate
    data = load_dataset("synthetic:1x4x4:3:60", "test")
    torch.manual_seed(0)
    for outputs, kept in ((3, True), (5, False)):
        engine = parallelize(nn.Sequential(nn.Flatten(), nn.Linear(16, outputs)), Strategy(), build_mesh())
        result = evaluate(engine, data, details=True)
        assert ("confusion" in result) == kept and 0 <= result["test_accuracy"] <= 1
        if kept:
            assert int(result["confusion"].sum()) == len(data)


def test_a_mixture_of_experts_run_gets_its_expert_load_figure():
    """results/moe-fortunes: one process and --ep 4, both with summary.json's `experts`; a run without
    experts gets no such figure."""
    from pathlib import Path

    from distlab.tools.report.runs import _expert_load
    root = Path(__file__).resolve().parent.parent / "results" / "moe-fortunes"
    runs = [{"path": str(root / d), "summary": json.loads((root / d / "summary.json").read_text()), "metrics": []}
            for d in ("one", "ep4")]
    assert all(sum(r["summary"]["experts"]["load"]) == r["summary"]["experts"]["routed"] for r in runs)
    assert _expert_load(runs).count("<img") == 1
    assert _expert_load([]) == ""


def test_the_gradient_norm_plot_draws_each_runs_clipping_threshold(monkeypatch):
    """A clipped run's norm before clipping, every logged step, and a line at its --clip-grad-norm: a
    point above the line is a step that was scaled down to it."""
    from distlab.tools.report import runs as section
    drawn = []
    monkeypatch.setattr(section, "png", lambda fig: drawn.append(fig) or "")
    metrics = [{"step": s, "loss": 1.0, "time_s": 0.1 * s, "grad_norm": g} for s, g in ((1, 0.5), (2, 0.625), (3, 0.75))]
    run = {"path": "r", "summary": {"dataset": "d", "world_size": 1, "strategy": {}, "config": {"clip_grad_norm": 0.5}},
           "metrics": metrics}
    try:
        section._runs_section("d", [run], [])
    except KeyError:  # the table wants a whole summary; the figures are drawn before it
        pass
    norm = next(f for f in drawn if "gradient norm" in f.axes[0].get_title())
    lines = norm.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[0.5, 0.625, 0.75], [0.5, 0.5]]
    assert "max norm 0.5" in lines[1].get_label()


def test_one_runs_malformed_summary_is_that_runs_problem_alone(run_cli, tmp_path):
    """A summary.json whose evals are not evaluations: that run is named and skipped; the other is drawn,
    and the directory given (".") is not said to hold nothing."""
    for name in ("good", "bad"):
        run_cli("train", "--mlp-widths", "8", "--dataset", "synthetic:1x4x4:3:240", "--max-steps", "3",
                "--global-batch-size", "12", "--no-progress", "--out", name, check=True)
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    summary["evals"] = "abc"
    (tmp_path / "bad" / "summary.json").write_text(json.dumps(summary))
    import os
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        inputs = collect(["."])
    finally:
        os.chdir(here)
    assert [p for p, _ in inputs.problems] == ["bad"]  # no blame on "." or on "good"
    assert inputs.problems[0][1].startswith("unreadable run: summary.json evals 'abc' is not a list of evaluations")
    assert [r["path"] for r in inputs.runs] == ["good"]


def test_a_trace_of_thousands_of_ranks_is_drawn_bounded_and_says_what_it_left_out(monkeypatch):
    """5,000 ranks: the chart draws the first and last eight, the table the first 64 (the page says so);
    a trace over the event limit is not drawn, and the page says why."""
    from distlab.tools.report import timelines
    drawn = []
    monkeypatch.setattr(timelines, "png", lambda fig: drawn.append(fig) or "")
    spans = [{"ph": "X", "name": n, "cat": "compute", "tid": 0, "ts": t, "dur": 1.0}
             for n, t in (("forward", 0.0), ("backward", 2.0))]
    trace = {"traceEvents": [{**s, "pid": p} for p in range(5000) for s in spans], "otherData": {"steps": [1, 1]}}
    page = timelines.timelines_section([{"path": "r", "summary": {"world_size": 5000, "strategy": {}},
                                         "trace": trace}])
    assert "Drawn: ranks 0-7 and 4992-4999 of 5,000; the table lists the first 64." in page
    assert len(drawn[0].axes[0].get_yticks()) == 16 and page.count("<tr>") == 65
    monkeypatch.setattr(timelines, "MAX_EVENTS", 1000)
    page = timelines.timelines_section([{"path": "r", "summary": {"world_size": 5000, "strategy": {}},
                                         "trace": trace}])
    assert "Not drawn: its trace holds 10,000 events, more than the 1,000 a page reads" in page
