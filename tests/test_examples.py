"""Every script under examples/ runs to completion, the way its docstring says to run it.

The examples assert their own claims (equal to single-process training, exact memory
predictions, bitwise resume, ...); here each must exit 0 and print its conclusion, and every
output block in docs/ marked as its output must agree with what it printed
(``scripts/doc_outputs.py`` says how a block is matched).
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(ROOT / "scripts"))
import doc_outputs  # noqa: E402 - scripts/ is not a package
from tests.conftest import run_patiently  # noqa: E402
# script -> (processes under torchrun, or None for plain python; text its output must contain)
RUNS = {
    "01_collectives.py": (4, "all-gather of the chunks: [6.0, 10.0"),
    "02_sampler.py": (None, "minibatch 1: ranks together"),
    "03_data_parallel.py": (2, "all three equal single-process training"),
    "04_grad_accumulation.py": (2, "one gradient sync per step whatever K is"),
    "05_sync_batchnorm.py": (2, "SyncBatchNorm matches one process"),
    "06_tensor_parallel.py": (2, "Both equal the unsharded model"),
    "07_zero.py": (2, "distlab plan predicted every peak exactly"),
    "08_fault_tolerance.py": (None, "and resumed from step-00000020 instead"),
    "09_emulated_cluster.py": (None, "predicted"),
    "10_pipeline.py": (2, "both schedules compute the unsplit step"),
    "11_3d_transformer.py": (8, "equal to single-process training"),
    "12_long_context.py": (2, "ring and Ulysses both equal single-process training"),
    "13_experts.py": (2, "experts split over the ranks train the single-process model"),
    "14_timelines.py": (2, "the slowest rank: 1"),
    "own_training_loop.py": (4, "equal to single-process training"),
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script, tmp_path):
    nproc, expected = RUNS[script]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--log-dir", str(tmp_path / "torchrun-logs"), str(EXAMPLES / script)]  # not a new one in /tmp
    else:
        cmd = [sys.executable, str(EXAMPLES / script)]
        if script in ("08_fault_tolerance.py", "09_emulated_cluster.py"):
            cmd.append(str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = run_patiently(cmd, 120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if "skipped:" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert expected in proc.stdout, proc.stdout[-3000:]
    shown = [b for b in doc_outputs.all_blocks() if f"examples/{script}" in b.command]
    for block in shown:
        assert doc_outputs.agrees(block.text, proc.stdout), (
            f"{block.where()} shows output that `{block.command}` no longer prints:\n--- page\n{block.text}\n"
            f"--- output\n{proc.stdout}\nrerun: python scripts/doc_outputs.py {block.page.relative_to(ROOT)}")


def test_pages_show_the_output_of_the_example_they_run():
    """Each example's page has at least one block checked against its output, and every block names
    a command the suite runs: an example as RUNS runs it, or a distlab command (tests/test_docs.py)."""
    blocks = doc_outputs.all_blocks()
    for script in RUNS:
        if script != "own_training_loop.py":  # the library example has no page of its own
            assert any(f"examples/{script}" in b.command for b in blocks), f"no page shows the output of {script}"
    for block in blocks:
        words = block.command.split()
        if any(w.startswith("examples/") for w in words):
            script = next(w for w in words if w.startswith("examples/"))[len("examples/"):]
            nproc = RUNS[script][0]
            runner = f"torchrun --standalone --nproc-per-node {nproc}" if nproc else "python"
            assert block.command.removeprefix("sudo ") == f"{runner} examples/{script}", block.where()
        else:
            assert words[0] == "distlab", block.where()
