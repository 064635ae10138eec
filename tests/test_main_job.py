"""The README's main job on real Fashion-MNIST, through the real CLI and torchrun: >= 84% in one epoch."""

import json
import os

import pytest

from distlab.data import locate
from distlab.errors import DataNotFoundError


def _fashion_mnist_or_skip():
    try:
        return locate("fashion-mnist")
    except DataNotFoundError as exc:
        if os.environ.get("DISTLAB_REQUIRE_REAL_DATA"):
            raise
        pytest.skip(f"real Fashion-MNIST not installed (make data installs it): {exc}")


@pytest.mark.slow
def test_one_epoch_mlp_on_two_processes_reaches_84_percent(run_cli, tmp_path):
    _fashion_mnist_or_skip()
    out = tmp_path / "quickstart"
    run_cli("train", "--nproc-per-node", "2", "--model", "mlp", "--dataset", "fashion-mnist", "--epochs", "1",
            "--out", str(out), timeout=600, check=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["dataset"] == "fashion-mnist"
    assert summary["evals"][-1]["test_samples"] == 10_000  # the whole test split, each sample once
    assert summary["steps"] == 60_000 // 64
    assert summary["test_accuracy"] >= 0.84
