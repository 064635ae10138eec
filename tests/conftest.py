import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Multi-rank tests run CPU ranks with gloo on any host, a GPU one included (one GPU cannot hold several
# ranks): the CLI, benches, examples and library calls read this; tests marked ``gpu`` ask for CUDA.
os.environ.setdefault("DISTLAB_DEVICE", "cpu")
# A test machine is busy by design (the suite runs on every core): runs take the load before them as 0, so
# the header's busy-machine warning does not come and go with the suite's own load (its test sets a load).
os.environ.setdefault("DISTLAB_LOAD_AT_LAUNCH", "0")


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests run where CUDA is present and skip, saying why, elsewhere."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def distlab_exe() -> list[str]:
    """The real console script when installed, else ``python -m distlab``."""
    exe = shutil.which("distlab", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "distlab"]


@pytest.fixture
def run_cli(tmp_path):
    """Run the distlab CLI in a subprocess; returns CompletedProcess (text)."""

    def run(*args: str, timeout: float = 180, env: dict | None = None, check: bool = False):
        # CPU ranks with gloo even on a GPU host (one GPU cannot hold two ranks).
        full_env = {**os.environ, "DISTLAB_DEVICE": "cpu", **(env or {})}
        full_env.pop("RANK", None)
        full_env.pop("WORLD_SIZE", None)
        proc = subprocess.run([*distlab_exe(), *args], capture_output=True, text=True, timeout=timeout,
                              cwd=tmp_path, env=full_env)
        if check and proc.returncode != 0:
            raise AssertionError(f"distlab {' '.join(args)} exited {proc.returncode}\n"
                                 f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    return run
