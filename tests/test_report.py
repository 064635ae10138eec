"""``distlab report``: a real run directory and bench/verify files in, one self-contained HTML page out;
bad inputs are listed, never fatal."""

import base64
import json
import re
import shutil
import subprocess

import pytest

from distlab.report import bench_kind, collect


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
    # Plots are embedded PNGs: loss curves + accuracy for the run, time/busbw for world size 2.
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    assert "<th>busbw_gbps</th>" in page and "<th>test accuracy</th>" in page and "<th>passed</th>" in page
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


CHROMIUM = next((shutil.which(c) for c in ("chromium", "chromium-browser", "google-chrome") if shutil.which(c)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here to render the page headless")
def test_report_renders_to_a_non_blank_screenshot(tmp_path):
    from distlab.report import write_report
    (tmp_path / "collectives.json").write_text(json.dumps(_collectives()))
    write_report([str(tmp_path / "collectives.json")], tmp_path / "r.html")
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,900", f"file://{tmp_path / 'r.html'}"], capture_output=True, timeout=120)
    from PIL import Image  # noqa: PLC0415 - matplotlib brings pillow
    pixels = Image.open(shot).convert("L").getextrema()
    assert pixels[0] < 128 < pixels[1]  # dark text/lines on a light page: not blank


def test_plan_validation_gets_its_plot_and_images_are_written(tmp_path):
    """`plan validate --json` output is a report input: a predicted-vs-measured plot and its table;
    --images writes every plot as a PNG file too."""
    from distlab.report import write_report
    rows = [{"run": f"r{i}", "world_size": 2, "link": "1gbit", "dp_sync": "ddp", "zero": 0, "measured_step_s": t,
             "predicted_step_s": t * 1.1, "time_rel_err": 0.1, "predicted_compute_s": 0.001,
             "predicted_exposed_comm_s": t, "measured_model_state_bytes": 10, "predicted_model_state_bytes": 10}
            for i, t in enumerate((0.01, 0.02))]
    path = tmp_path / "validate.json"
    path.write_text(json.dumps({"kind": "distlab-plan-validation", "summary": {}, "runs": rows}))
    inputs = write_report([str(path)], tmp_path / "r.html", images=tmp_path / "img")
    page = (tmp_path / "r.html").read_text()
    assert inputs.read == [(str(path), "plan")] and not inputs.problems
    assert "Cost model" in page and "<td>r1</td>" in page and "<th>predicted_step_s</th>" in page
    assert [p.name for p in inputs.images] == ["01-distlab-plan--predicted-vs-measured--med.png"]
    assert inputs.images[0].read_bytes()[:4] == b"\x89PNG"


def test_plan_sweep_gets_memory_and_fit_plot(tmp_path):
    from distlab.parallel import Strategy
    from distlab.plan import Layout, Link, generic_trace, sweep
    from distlab.report import write_report
    rows = sweep(generic_trace(10**9, 0.0, 8), Layout(dp=8, optimizer="adam"), [8, 64], Link(), None, 8 * 2**30,
                 [Strategy(), Strategy(zero=3)])
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(rows))
    inputs = write_report([str(path)], tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert inputs.read == [(str(path), "sweep")] and not inputs.problems
    assert "Plan sweep" in page and "<td>zero=3</td>" in page and page.count("data:image/png") == 1
