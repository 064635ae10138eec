import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time
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


def mlp_only(settings: dict) -> dict:
    """A test's training settings without the MLP's widths where another model is asked for (a model
    is given only the options it takes)."""
    return settings if settings.get("model") in ("mlp", "mlp-bn") else {k: v for k, v in settings.items()
                                                                          if k != "mlp_widths"}


def run_patiently(cmd: list[str], timeout: float, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` with ``timeout`` as a hang guard
    for a quiet machine: the deadline stretches with the load per core seen while it runs (a test suite
    on a busy CI machine is slow, not hung); past it the process is killed and TimeoutExpired raised."""
    from distlab.runtime.device import load_stretch
    began, stretch = time.monotonic(), load_stretch()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=1.0)
                done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
                if check:
                    done.check_returncode()
                return done
            except subprocess.TimeoutExpired:
                stretch = max(stretch, load_stretch())
                if time.monotonic() > began + timeout * stretch:
                    proc.kill()
                    out, err = proc.communicate()
                    raise subprocess.TimeoutExpired(cmd, timeout * stretch, out, err) from None


def patience(seconds: float) -> float:
    """``seconds`` of waiting on a quiet machine, stretched by the load per core now."""
    from distlab.runtime.device import load_stretch
    return seconds * load_stretch()


def communicate_patiently(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout=...)`` whose deadline stretches with the load seen while waiting."""
    from distlab.runtime.device import load_stretch
    began, stretch = time.monotonic(), load_stretch()
    while True:
        try:
            return proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            stretch = max(stretch, load_stretch())
            if time.monotonic() > began + timeout * stretch:
                raise


@pytest.fixture
def run_cli(tmp_path):
    """Run the distlab CLI in a subprocess; returns CompletedProcess (text)."""

    def run(*args: str, timeout: float = 180, env: dict | None = None, check: bool = False, **popen):
        # CPU ranks with gloo even on a GPU host (one GPU cannot hold two ranks).
        full_env = {**os.environ, "DISTLAB_DEVICE": "cpu", **(env or {})}
        full_env.pop("RANK", None)
        full_env.pop("WORLD_SIZE", None)
        proc = run_patiently([*distlab_exe(), *args], timeout, cwd=tmp_path, env=full_env, **popen)
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
