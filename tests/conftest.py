import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
    """Run the distlab CLI as a user does; returns CompletedProcess (text) with everything the command and
    the workers it launched printed.

    By default the command runs in this process (:func:`invoke`, its output caught at the file descriptors so
    that a launch's workers are heard too): a user's process runs the same code, and this one has imported
    torch already -- ~2 s of a 2-core machine saved per command. ``fresh=True`` (``DISTLAB_TEST_FRESH=1``: for
    every command) starts a new interpreter instead, for what only a process of its own shows -- an environment
    read at import, a deadline (``timeout`` holds there; in this process pytest-timeout is the hang guard)."""

    def run(*args: str, timeout: float = 180, env: dict | None = None, check: bool = False, fresh: bool = False,
            **popen):
        # CPU ranks with gloo even on a GPU host (one GPU cannot hold two ranks).
        full_env = {**os.environ, "DISTLAB_DEVICE": "cpu", **(env or {})}
        full_env.pop("RANK", None)
        full_env.pop("WORLD_SIZE", None)
        if fresh or popen or os.environ.get("DISTLAB_TEST_FRESH") == "1":
            proc = run_patiently([*distlab_exe(), *args], timeout, cwd=tmp_path, env=full_env, **popen)
        else:
            code, out, err = invoke(list(args), tmp_path, env=full_env, fds=True)
            proc = subprocess.CompletedProcess(["distlab", *args], code, out, err)
        if check and proc.returncode != 0:
            raise AssertionError(f"distlab {' '.join(args)} exited {proc.returncode}\n"
                                 f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    return run


@contextlib.contextmanager
def _caught(fds: bool):
    """``sys.stdout`` and ``sys.stderr`` caught while open -- with ``fds``, at file descriptors 1 and 2, so
    that the processes started meanwhile are caught too. Yields a list that holds (stdout, stderr) on exit."""
    caught: list[str] = []
    if not fds:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield caught
        finally:
            caught += [out.getvalue(), err.getvalue()]
        return
    sys.stdout.flush()
    sys.stderr.flush()
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    saved = [os.dup(1), os.dup(2)]
    streams = []
    try:
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        streams = [open(fd, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False) for fd in (1, 2)]
        with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
            yield caught
    finally:
        for stream in streams:
            stream.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        for f in files:
            f.seek(0)
            caught.append(f.read().decode("utf-8", errors="replace"))
            f.close()


def invoke(argv: list[str], cwd, env: dict | None = None, fds: bool = False) -> tuple[int, str, str]:
    """Run ``distlab ARGV`` in this process; (exit code, stdout, stderr). ``env``: the environment it runs in
    (default: this one); ``fds``: output caught at the file descriptors, a launch's workers' included. What a
    command may change in its process is restored afterwards: the environment, working directory, command
    line, ``sys.path``, signal handlers, torch's threads, default dtype, grad mode and random generators, and
    the user models it loaded. An exception that escapes prints its traceback and exits 1, as a process of
    its own would."""
    import random
    import traceback

    import numpy as np
    import torch

    from distlab.runtime import user_code
    from distlab.cli import main
    saved_env, here, threads, args, path = dict(os.environ), os.getcwd(), torch.get_num_threads(), sys.argv, list(sys.path)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    modules, loaded = set(sys.modules), dict(user_code._LOADED)
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["distlab", *argv]  # a launch re-runs the command line under torchrun
    try:
        with _caught(fds) as caught:
            try:
                main(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # noqa: BLE001 - what a process of its own prints before it exits 1
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
        sys.argv = args
        sys.path[:] = path
        for sig, handler in handlers.items():  # torchrun's agent installs its own and leaves them
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        user_code._LOADED.clear()
        user_code._LOADED.update(loaded)
        for name in set(sys.modules) - modules:  # a user's model file or package: the next command loads its own
            if name.startswith("distlab_user_") or \
                    (getattr(sys.modules[name], "__file__", None) or "").startswith(str(cwd)):
                del sys.modules[name]
    return code, caught[0], caught[1]


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
