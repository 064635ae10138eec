"""Every script under examples/ runs to completion, the way its docstring says to run it.

The examples assert their own claims (equal to single-process training, exact memory
predictions, bitwise resume, ...); here each must exit 0 and print its conclusion.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
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
    "10_own_training_loop.py": (4, "equal to single-process training"),
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script, tmp_path):
    nproc, expected = RUNS[script]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(EXAMPLES / script)]
    else:
        cmd = [sys.executable, str(EXAMPLES / script)]
        if script in ("08_fault_tolerance.py", "09_emulated_cluster.py"):
            cmd.append(str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if "skipped:" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert expected in proc.stdout, proc.stdout[-3000:]
