import contextlib
import io
import os
import shutil
import signal
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


def invoke(argv: list[str], cwd) -> tuple[int, str, str]:
    """Run ``distlab ARGV`` in this process; (exit code, stdout, stderr). The environment, working
    directory, signal handlers and torch's threads are restored afterwards (commands set variables for
    the workers they start). No interpreter or torch start-up: for commands refused before any work."""
    import torch

    from distlab.cli import main
    env, here, threads, args = dict(os.environ), os.getcwd(), torch.get_num_threads(), sys.argv
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    out, err = io.StringIO(), io.StringIO()
    os.chdir(cwd)
    sys.argv = ["distlab", *argv]  # a launch re-runs the command line under torchrun
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(here)
        sys.argv = args
        for sig, handler in handlers.items():  # torchrun's agent installs its own and leaves them
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def refused_here(tmp_path):
    """``run_cli``'s twin for a command that must be refused before any work: run in this process (no
    interpreter and torch start-up, a few seconds each), asserting it exits 2; returns the
    CompletedProcess-like result."""

    def run(*args: str):
        code, out, err = invoke(list(args), tmp_path)
        assert code == 2, f"distlab {' '.join(args)} exited {code}, not 2 (refused)\nstdout:\n{out}\nstderr:\n{err}"
        return subprocess.CompletedProcess(["distlab", *args], code, out, err)

    return run
