"""Hand-off to torchrun's own launcher (``torch.distributed.run``) for the commands users run.

(:mod:`distlab.launch.spawn` starts local ranks for code that wants their results back in-process:
``verify``, the benches, tests.)

``distlab CMD --nproc-per-node N ...`` outside any launcher re-runs ``python -m distlab CMD ...``
under torchrun with the same arguments; the workers see torchrun's environment and just run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from distlab.errors import ConfigError, DistributedError
from distlab.launch import prefork
from distlab.runtime import LAUNCHER_PID, LOAD_AT_LAUNCH, cores, port_in_use
from distlab.runtime.launch import ERROR_LINES, unsaid_error_line


@dataclass
class LaunchOptions:
    nproc_per_node: int | None = None
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    threads: int | None = None
    rdzv_conf: str | None = None
    local_addr: str | None = None

    @property
    def max_nodes(self) -> int:
        try:
            return int(self.nnodes.split(":")[-1])
        except ValueError:
            raise ConfigError(f"--nnodes {self.nnodes!r} is not N or MIN:MAX") from None

    @property
    def elastic(self) -> bool:
        return ":" in self.nnodes

    def possible_world_sizes(self) -> list[int]:
        """Every world size the job may run at: one per node count of a MIN:MAX range."""
        try:
            low, high = (int(v) for v in self.nnodes.split(":")) if self.elastic else (self.max_nodes,) * 2
        except ValueError:
            raise ConfigError(f"--nnodes {self.nnodes!r} is not N or MIN:MAX") from None
        if not 1 <= low <= high:
            raise ConfigError(f"--nnodes {self.nnodes}: need 1 <= MIN <= MAX")
        return [(self.nproc_per_node or 1) * n for n in range(low, high + 1)]


def torchrun_args(opts: LaunchOptions, argv: list[str], log_dir: str | None = None,
                  worker: list[str] | None = None) -> list[str]:
    """The torchrun command line equivalent to this launch (without the ``torchrun`` word); ``worker``: the
    command each worker runs instead of ``python -m distlab`` (a prefork client: :mod:`distlab.launch.prefork`)."""
    args = ["--nproc-per-node", str(opts.nproc_per_node), "--nnodes", opts.nnodes,
            "--max-restarts", str(opts.max_restarts)]
    args += ["--log-dir", log_dir] if log_dir else []
    if opts.rdzv_endpoint:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", opts.rdzv_endpoint]
        args += ["--rdzv-conf", opts.rdzv_conf] if opts.rdzv_conf else []
        args += ["--local-addr", opts.local_addr] if opts.local_addr else []
    elif opts.master_port is None and opts.max_nodes == 1:
        # One node and no port asked for: a rendezvous on a free port (torchrun --standalone). torch
        # before 2.12 otherwise binds the static rendezvous to 29500, and two jobs on a host collide.
        args += ["--standalone"]
    else:
        args += ["--node-rank", str(opts.node_rank)]
        if opts.master_addr:
            args += ["--master-addr", opts.master_addr]
        if opts.master_port is not None:
            args += ["--master-port", str(opts.master_port)]
    return args + (["--no-python", *worker] if worker else ["-m", "distlab", *argv])


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in a command line (the last one given)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def failure_report(failures: dict[int, tuple[int | None, float]], argv: list[str]) -> str:
    """One line for workers that failed: ``{rank: (exit code, time)}`` from torchrun's agent.

    Names the rank that failed first and how (a signal, or an exit code after its own message), the
    ranks torchrun then stopped, the last logged step (``--out``'s metrics.jsonl) and, when there are
    snapshots in ``--snapshot-dir``, how to go on from the newest.
    """
    from pathlib import Path

    from distlab.train.snapshot import snapshots

    # torchrun stops the survivors with SIGTERM once one worker failed: those never come first.
    order = sorted(failures, key=lambda r: (failures[r][0] == -signal.SIGTERM, failures[r][1] or 0, r))
    first = order[0]
    stopped = [r for r in order[1:] if failures[r][0] == -signal.SIGTERM]
    others = [r for r in order[1:] if r not in stopped]
    parts = [f"rank {first} {_describe_exit(failures[first][0])} first"]
    parts += [f"rank {r} {_describe_exit(failures[r][0])}" for r in others]
    if stopped:
        parts.append(f"torchrun then stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))}")
    line = "workers failed: " + "; ".join(parts)
    if any((failures[r][0] or 0) > 0 for r in failures):
        line += " (their own messages are above)"
    out = _flag_value(argv, "--out")
    step = _last_logged_step(Path(out) / "metrics.jsonl") if out else None
    if step is not None:
        line += f"; last logged step {step}"
    snap_dir = _flag_value(argv, "--snapshot-dir")
    found = snapshots(snap_dir) if snap_dir else []
    if found:
        line += (f"; snapshots in {snap_dir} (newest {found[0].name}): rerun the same command with --resume auto "
                 f"to go on from there")
    elif snap_dir:
        line += f"; no snapshot in {snap_dir} yet"
    return line


def restart_line(failures: dict, argv: list[str], restart: int, restarts: int) -> str:
    """What the launcher says when torchrun restarts the worker group: ``failures`` (global rank ->
    torch's ``ProcessFailure``: pid, exit code, time) name the worker that died first and of what, the
    last logged step says where, and the snapshot directory what the group resumes from."""
    from distlab.train.snapshot import snapshots

    order = sorted(failures, key=lambda r: (failures[r].exitcode == -signal.SIGTERM,
                                            getattr(failures[r], "timestamp", 0) or 0, r))
    first = failures[order[0]]
    line = f"distlab: rank {order[0]} (pid {first.pid}) {_describe_exit(first.exitcode)}"
    out = _flag_value(argv, "--out") or os.environ.get("DISTLAB_OUT")
    step = _last_logged_step(Path(out) / "metrics.jsonl") if out else None
    line += f" after step {step} (the last logged)" if step is not None else " before the first logged step"
    line += f"; restarting the worker group (restart {restart} of {restarts})"
    snap_dir = _flag_value(argv, "--snapshot-dir")
    found = snapshots(snap_dir) if snap_dir else []
    if found:
        return line + f", resuming from the newest good snapshot in {snap_dir} ({found[0].name})"
    return line + (f": no snapshot in {snap_dir} yet, so from step 0" if snap_dir else
                   ": no --snapshot-dir, so from step 0")


def _last_logged_step(metrics: Path) -> int | None:
    try:
        lines = metrics.read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


@contextlib.contextmanager
def _announcing_restarts(argv: list[str]):
    """While torchrun runs: say at once, in one line, when its agent restarts the worker group after a
    failure (torch's agent does so silently at the log level distlab keeps). Wraps the local agent's
    monitor, which returns the failures the agent is about to act on; restored afterwards."""
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        original = LocalElasticAgent._monitor_workers
    except (ImportError, AttributeError):  # another torch: no announcement, nothing else changes
        yield
        return

    def monitor(agent, worker_group):
        result = original(agent, worker_group)
        left = getattr(agent, "_remaining_restarts", 0)
        if result.state.name in ("FAILED", "UNHEALTHY") and left > 0 and result.failures:
            total = worker_group.spec.max_restarts
            print(restart_line(result.failures, argv, total - left + 1, total), file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original


@contextlib.contextmanager
def _second_ctrl_c_stops_at_once(logs: str):
    """While torchrun runs: its agent turns a first SIGINT (or SIGTERM) into a clean stop of the workers
    and waits for it; a second SIGINT stops the job at once -- this process exits 130, and the workers,
    in sessions of their own that a terminal's Ctrl-C does not reach, die with it (their parent-death
    signal). The step in progress is lost; earlier snapshots are intact."""
    try:
        from torch.distributed.elastic.multiprocessing import api
        original = api._terminate_process_handler
    except (ImportError, AttributeError):  # another torch: its own handling stays
        yield
        return
    seen = []

    def handler(signum, frame):
        if signum == signal.SIGINT and signal.SIGINT in seen:
            print("distlab: stopped at once (a second Ctrl-C): the step in progress is lost; earlier snapshots "
                  "are intact", file=sys.stderr, flush=True)
            shutil.rmtree(logs, ignore_errors=True)
            os._exit(128 + signal.SIGINT)
        seen.append(signum)
        original(signum, frame)  # raises torch's SignalException: the agent stops the workers cleanly

    api._terminate_process_handler = handler
    try:
        yield
    finally:
        api._terminate_process_handler = original


def _fresh_summary(argv: list[str], since: float) -> tuple[str | None, dict | None]:
    """The run's ``--out`` and its summary.json if written after ``since`` (by this launch's workers)."""
    out = _flag_value(argv, "--out") or os.environ.get("DISTLAB_OUT")
    summary = None
    if out:
        path = Path(out) / "summary.json"
        with contextlib.suppress(OSError, ValueError, RecursionError):
            if path.stat().st_mtime >= since:
                summary = json.loads(path.read_text())
    return out, summary if isinstance(summary, dict) else None


def _stopped_by_signal(sig: int, argv: list[str], since: float) -> int:
    """torchrun's agent got ``sig`` and passed it on: 0 if the workers stopped cleanly as preempted
    (a summary written after ``since`` says so), else 128 + the signal's number, with a line saying
    what happened."""
    out, summary = _fresh_summary(argv, since)
    name = signal.Signals(sig).name
    if summary and summary.get("stopped") in ("preempted", "interrupted"):
        where = f"; snapshot {summary['snapshot']} (continue with --resume auto)" if summary.get("snapshot") else \
            "; no --snapshot-dir, so the progress is lost"
        print(f"distlab: stopped by {name} at step {summary['steps']} as asked{where}", file=sys.stderr, flush=True)
        return 0 if summary["stopped"] == "preempted" else 128 + int(sig)  # Ctrl-C: the shell's "interrupted"
    if summary and summary.get("stopped") in FINISHED:  # the signal came as the run did its last step
        print(f"distlab: warning: {name} came as the run finished (step {summary.get('steps')}, {out}/summary.json "
              f"written): its results are complete", file=sys.stderr, flush=True)
        return 0
    if sig == signal.SIGINT:
        print("distlab: stopped at once (a second Ctrl-C): the step in progress is lost; earlier snapshots are "
              "intact", file=sys.stderr, flush=True)
        return 128 + int(sig)
    print(f"distlab: error: stopped by {name} before the workers had stopped cleanly (no preempted summary"
          f"{f' in {out}' if out else ''})", file=sys.stderr, flush=True)
    return 128 + int(sig)


FINISHED = ("completed", "time_budget")  # a summary's `stopped` when the run did all it was asked to
STOP_GRACE_S = 600  # how long torchrun's agent lets signalled workers stop before it kills them


def agent_environment(opts: LaunchOptions) -> dict[str, str]:
    """The environment torchrun's agent and the workers run in: this one with distlab's settings added
    (a value the user set is kept)."""
    env = dict(os.environ)
    # One thread per core: N ranks on C cores get C // N threads each (torchrun would force 1).
    env.setdefault("OMP_NUM_THREADS", str(opts.threads or max(1, cores() // opts.nproc_per_node)))
    # The agent passes SIGTERM or Ctrl-C on and SIGKILLs the workers 30 s later: too soon for a big
    # model's stop snapshot. The scheduler's own grace period (Slurm's KillWait, Kubernetes'
    # terminationGracePeriodSeconds) or a second Ctrl-C decides instead; the agent's limit is only
    # there for a worker that hangs (torch 2.13 on reads it; older agents wait 30 s).
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_S))
    with contextlib.suppress(AttributeError, OSError):  # the load before the workers add theirs (the header's warning)
        env.setdefault(LOAD_AT_LAUNCH, f"{os.getloadavg()[0]:.2f}")
    if opts.elastic:
        # torch's agents share one TCP store across rendezvous rounds and publish its address only in
        # the first round they take part in: a node that joins a later round waits for an address
        # nobody writes. Without sharing, rank 0 publishes it every round (and hosts the workers' store).
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def launch(opts: LaunchOptions, argv: list[str]) -> int:
    """Run ``python -m distlab *argv`` on ``nproc_per_node`` local workers under torchrun.

    Returns the exit code: 0, or the first failed worker's exit code.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if opts.nproc_per_node is None or opts.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, not {opts.nproc_per_node}")
    if opts.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0, not {opts.max_restarts}")
    if opts.elastic and not opts.rdzv_endpoint:
        raise ConfigError(f"--nnodes {opts.nnodes} (elastic) needs --rdzv-endpoint HOST:PORT: a fixed master cannot "
                          f"take nodes in or let them go")
    if opts.rdzv_conf and not opts.rdzv_endpoint:
        raise ConfigError("--rdzv-conf sets up the c10d rendezvous of --rdzv-endpoint: give that too")
    addr = opts.master_addr or "127.0.0.1"
    if (not opts.rdzv_endpoint and opts.node_rank == 0 and opts.master_port is not None
            and port_in_use(addr if addr != "localhost" else "127.0.0.1", opts.master_port)):
        raise DistributedError(f"port {opts.master_port} on {addr} is already in use; pick a free one "
                               f"with --master-port (another job may be running there)")
    os.environ.update(agent_environment(opts))
    # The agent logs every signal and failure with a banner; workers report their own errors,
    # so keep it quiet unless asked (DISTLAB_TORCHRUN_LOG=INFO shows everything).
    level = os.environ.get("DISTLAB_TORCHRUN_LOG", "CRITICAL")
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:  # torch sets each module's own level
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(level)
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers die with this process (runtime.follow_launcher)
    started = time.time()
    # torchrun's agent keeps its workers' error files in a log directory (a new one in the temporary
    # directory unless given, left behind by every launch): one of ours, removed when the job ends.
    logs = tempfile.TemporaryDirectory(prefix="distlab-torchrun-")
    said = Path(logs.name) / "error-lines"  # runtime.launch.keep_error_line
    said.mkdir()
    os.environ[ERROR_LINES] = str(said)
    # Workers forked from a server that imported torch once, not N new interpreters importing it each
    worker = prefork.worker_command(argv) if prefork.enabled() else None
    try:
        if worker:
            prefork.ensure_server()
        with _announcing_restarts(argv), _second_ctrl_c_stops_at_once(logs.name):
            run(parse_args(torchrun_args(opts, argv, logs.name, worker)))
    except SignalException as exc:
        return _stopped_by_signal(exc.sigval, argv, started)
    except ChildFailedError as exc:
        codes = {rank: f.exitcode for rank, f in exc.failures.items()}
        out, summary = _fresh_summary(argv, started)
        if (summary or {}).get("stopped") in FINISHED:  # a worker died after the run was complete
            failures = ", ".join(f"rank {r} {_describe_exit(c)}" for r, c in sorted(codes.items()))
            print(f"distlab: warning: {failures} after the run had finished (step {summary.get('steps')}, "
                  f"{out}/summary.json written): its results are complete", file=sys.stderr, flush=True)
            return 0
        first = next((c for c in codes.values() if c and c > 0), 1)
        # A config error: every rank exits with its code (or is stopped); rank 0 already said what was wrong.
        config_error = ConfigError.exit_code in codes.values() and \
            all(c in (ConfigError.exit_code, -signal.SIGTERM) for c in codes.values())
        # Every rank stopped on non-finite gradients at the same step: rank 0 said so in one line.
        diverged = (summary or {}).get("stopped") in ("non_finite", "final_write_failed")  # (or its last write failed)
        # Unless torchrun's agent stopped rank 0 before it could (another rank got there first): then
        # the launcher says the line the workers kept.
        unsaid = unsaid_error_line(said) if (config_error or diverged) and opts.node_rank == 0 else None
        if unsaid:
            print(unsaid, file=sys.stderr, flush=True)
        elif not ((config_error or diverged) and opts.node_rank == 0):
            failures = {r: (f.exitcode, getattr(f, "timestamp", 0)) for r, f in exc.failures.items()}
            print(f"distlab: error: {failure_report(failures, argv)}", file=sys.stderr, flush=True)
        return first
    finally:
        logs.cleanup()
    return 0
