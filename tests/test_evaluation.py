"""Evaluation during training: every N steps (``--eval-every``), on a fixed capped subset
(``--eval-batches``), perplexity for language models, each evaluation in its step's metrics.jsonl
record and the last one's step in summary.json; label smoothing of the training loss."""

import json
import math

import torch

from distlab.data import load_dataset
from distlab.train.evaluate import first_batches


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_eval_every_n_steps_on_a_capped_subset_joins_the_metrics_and_the_summary_says_its_step(run_cli, tmp_path):
    proc = run_cli("train", "--nproc-per-node", "2", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "8",
                   "--max-steps", "10", "--global-batch-size", "16", "--eval-every", "4", "--eval-batches", "2",
                   "--eval-batch-size", "8", "--log-every", "5", "--val-fraction", "0.25", "--out", "r",
                   "--no-progress", check=True)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [4, 8, 10] and summary["eval_step"] == 10
    assert all(e["test_samples"] == 16 and "val_loss" in e for e in summary["evals"])  # 2 batches of 8
    records = _records(tmp_path / "r")
    assert [r["step"] for r in records] == [4, 5, 8, 10]  # the log steps and the evaluations' steps
    by_step = {r["step"]: r for r in records}
    assert "test_loss" not in by_step[5] and all("loss" in r for r in records)
    for e in summary["evals"]:
        assert by_step[e["step"]]["test_loss"] == e["test_loss"]
        assert by_step[e["step"]]["val_loss"] == e["val_loss"]
    assert "eval step 4 (epoch 0)" in proc.stdout
    from distlab.tools.report import write_report
    inputs = write_report([str(tmp_path / "r")], tmp_path / "report.html", images=tmp_path / "img")
    assert [p.name for p in inputs.images if "evaluations" in p.name], [p.name for p in inputs.images]


def test_the_capped_subset_is_the_first_samples_and_the_whole_set_when_it_holds_fewer(tmp_path):
    data = load_dataset("synthetic:1x8x8:4:64", "test")
    first = first_batches(data, 2, 5)
    assert len(first) == 10 and torch.equal(first.batch(torch.arange(10))[0], data.batch(torch.arange(10))[0])
    assert first_batches(data, 1000, 5) is data and first_batches(data, None, 5) is data


def test_a_language_models_evaluation_reports_its_perplexity_every_time(run_cli, tmp_path):
    run_cli("train", "--model", "gpt", "--dataset", "synthetic-text:3000", "--n-layer", "1", "--n-head", "2",
            "--n-embd", "16", "--block-size", "16", "--max-steps", "4", "--global-batch-size", "8",
            "--eval-every", "2", "--eval-batches", "1", "--eval-batch-size", "8", "--out", "r", "--no-progress",
            check=True)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [2, 4]
    for e in summary["evals"]:
        assert e["test_samples"] == 8 and e["test_tokens"] == 8 * 16  # of the 18 windows of the test text
        assert e["test_perplexity"] == math.exp(e["test_loss"])
    assert all("test_perplexity" in r for r in _records(tmp_path / "r") if "test_loss" in r)


def test_a_language_model_evaluates_as_many_windows_at_a_time_as_its_logits_budget_holds(run_cli, tmp_path):
    """1,000 samples at a time is a classifier's default; a language model scores as many windows as 256 MiB
    of float32 logits (three copies: logits, exponentials, log-probabilities) hold on a rank -- never fewer
    than its training micro-batch (a 2,048-token window over 128k tokens holds one), at most 16,000: a 16-token
    window over 256 tokens scores 5,461 at a time, not its micro-batch of 1 (8,208 windows two at a time were
    200 s of a 200.6 s run). The header says it; --eval-batch-size still decides when given."""
    from distlab.train.evaluate import LOGITS_BUDGET, eval_batch
    assert eval_batch(None, False, 4) == 1000 and eval_batch(7, True, 4) == 7 and eval_batch(None, True, 0) == 1
    assert eval_batch(None, True, 1, 16 * 256) == LOGITS_BUDGET // (3 * 4 * 16 * 256) == 5461
    assert eval_batch(None, True, 4, 2048 * 128256) == 4 and eval_batch(None, True, 1, 1) == 16000
    proc = run_cli("train", "--model", "gpt", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--dataset",
                   "synthetic-text:4000", "--block-size", "16", "--global-batch-size", "2", "--nproc-per-node", "2",
                   "--max-steps", "1", "--no-progress", "--out", str(tmp_path / "run"), check=True)
    assert "test windows, 5,461 at a time per rank" in proc.stdout, proc.stdout


def test_eval_and_smoothing_settings_out_of_range_are_refused(refused_here):
    for flags, name in ((("--eval-every", "0"), "eval_every"), (("--eval-batches", "0"), "eval_batches"),
                        (("--eval-batch-size", "0"), "eval_batch_size"),
                        (("--label-smoothing", "1"), "label_smoothing"), (("--label-smoothing", "-0.1"), "label")):
        proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:64", "--max-steps", "1", *flags)
        assert proc.returncode == 2 and name.replace("_", "-") in proc.stderr, (flags, proc.stderr)


def test_verify_holds_label_smoothing_to_one_process_on_a_split_vocabulary(tmp_path):
    from distlab.tools.verify import parse_strategy, verify
    records = verify([parse_strategy("allreduce+smooth"), parse_strategy("allreduce+tp=2+gpt+smooth")], 2, steps=3,
                     timeout=240)
    assert all(r["passed"] for r in records), records
    assert [r["flags"]["label_smoothing"] for r in records] == [0.1, 0.1]


EVAL_65K = """
import resource, sys, torch
from dataclasses import replace
from distlab.data.text import TextDataset
from distlab.models import GPT
from distlab.parallel import Strategy, build_mesh, parallelize
from distlab.train.evaluate import evaluate
V = 65536
stream = torch.randint(0, V, (8 * 64 + 1,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
data = replace(TextDataset.from_tokens("ids", "test", stream, 8, "generated"), num_classes=V)
engine = parallelize(GPT(V, 8, n_layer=1, n_head=2, n_embd=16), Strategy(), build_mesh())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
result = evaluate(engine, data, batch_size=16, details=True)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
print(grew, result["test_tokens"], "confusion" in result)
"""


def test_a_language_models_evaluation_does_not_grow_with_the_vocabulary_squared(tmp_path):
    """A 65,536-token vocabulary: the evaluation holds a batch's logits (16 x 8 x 65,536 floats, 32 MiB) and
    their softmax's work, well under 256 MB more than the process held before -- not a vocabulary x
    vocabulary confusion matrix (32 GiB in float64), which is a classifier's."""
    import sys
    from tests.conftest import run_patiently
    proc = run_patiently([sys.executable, "-c", EVAL_65K], 300, check=True, cwd=tmp_path)
    grew, tokens, confusion = proc.stdout.split()
    assert float(grew) < 256 and int(tokens) == 64 * 8 and confusion == "False", proc.stdout
