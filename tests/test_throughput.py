"""Tokens/s and MFU: the model's own FLOPs per token (checked against torch's FLOP counter), the peak
per device (--peak-tflops or a GPU's data sheet), in every log record, the log line and the summary."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distlab.models import flops_per_token, task_loss
from distlab.models.gpt import GPT
from distlab.runtime.device import peak_of


@pytest.mark.parametrize("experts", [0, 4])
def test_a_gpts_flops_per_token_are_what_its_step_computes(experts):
    torch.manual_seed(0)
    model = GPT(64, 16, n_layer=2, n_head=4, n_embd=32, experts=experts, top_k=2)
    x, y = torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))
    with FlopCounterMode(display=False) as counter:
        task_loss(model(x), y).backward()
    # torch's counter counts every matrix multiplication of forward and backward exactly (the experts'
    # on the slots routed to them); attention's scores and weighted values it does not count on a CPU
    attention = 12 * 2 * 32 * 16
    assert flops_per_token(model) == counter.get_total_flops() / (3 * 16) + attention
    assert flops_per_token(torch.nn.Linear(2, 2)) is None


def test_a_gpus_peak_comes_from_its_name_and_precision():
    assert peak_of("NVIDIA A100-SXM4-80GB", "bf16")[0] == 312.0 and peak_of("NVIDIA A10", "bf16")[0] == 125.0
    assert peak_of("NVIDIA H100 80GB HBM3", "fp32")[0] == 66.9 and peak_of("NVIDIA L4", "fp16")[0] == 121.0
    assert peak_of("NVIDIA L40S", "bf16")[0] == 362.1
    none, why = peak_of("Some New GPU", "bf16")
    assert none is None and "--peak-tflops" in why
    assert peak_of("Tesla V100-SXM2-16GB", "bf16")[0] is None  # no bf16 there


def test_tokens_per_second_and_mfu_are_logged_and_summarised(run_cli, tmp_path):
    flags = ["train", "--model", "gpt", "--dataset", "synthetic-text:4000", "--n-layer", "1", "--n-head", "2",
             "--n-embd", "16", "--block-size", "8", "--max-steps", "4", "--log-every", "2", "--global-batch-size", "8",
             "--no-progress"]
    proc = run_cli(*flags, "--peak-tflops", "0.25", "--out", "r", check=True)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    fpt = GPT(256, 8, n_layer=1, n_head=2, n_embd=16).flops_per_token()
    assert summary["flops_per_token"] == fpt and summary["peak_tflops_per_device"] == 0.25
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 8, rel=1e-12)
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * fpt / 0.25e12, rel=1e-12)
    for record in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()):
        assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * 8, rel=1e-12)
        assert record["mfu"] == pytest.approx(record["tokens_per_s"] * fpt / 0.25e12, rel=1e-12)
    assert "tokens/s | MFU " in proc.stdout
    from distlab.tools.report import write_report
    write_report([str(tmp_path / "r")], tmp_path / "report.html", images=tmp_path / "img")
    page = (tmp_path / "report.html").read_text()
    assert "<th>MFU</th>" in page and f"{100 * summary['mfu']:.2f}%" in page
    run_cli(*flags, "--out", "cpu", check=True)  # no peak known for a CPU: tokens/s, and why no MFU
    summary = json.loads((tmp_path / "cpu" / "summary.json").read_text())
    assert summary["tokens_per_s"] > 0 and summary["mfu"] is None and "--peak-tflops" in summary["peak_basis"]


def test_a_peak_that_is_not_positive_is_refused(refused_here):
    proc = refused_here("train", "--model", "gpt", "--dataset", "synthetic-text:4000", "--peak-tflops", "0")
    assert "--peak-tflops must be positive" in proc.stderr
