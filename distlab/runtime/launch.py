"""Where this process stands in the job, read from its launcher's environment (torchrun, mpirun,
Slurm) or flags: :class:`LaunchInfo` (:func:`detect_launch`), whether a distlab launcher started it,
the error line a worker leaves its launcher, and free ports. The launchers and the variables read
are listed in :mod:`distlab.runtime`."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from distlab.errors import ConfigError

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment (or the flags) says about this process's place in the job."""

    launcher: str  # "manual" | "torchrun" | "mpirun" | "slurm" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def slurm_first_host(nodelist: str) -> str:
    """First host of a Slurm host list: ``"node[01-04,07],gpu5"`` -> ``"node01"``.

    Implements the part of Slurm's hostlist syntax needed to find the first host (what
    ``scontrol show hostnames | head -1`` prints) without needing ``scontrol``.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ConfigError("the Slurm node list is empty; set MASTER_ADDR or pass --master-addr")
    # The first comma outside brackets ends the first entry.
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end]
    # Expand each bracket group to its first element: "rack[1-2]-n[05,07]" -> "rack1-n05".
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], entry)


def detect_launch(
    env: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> LaunchInfo:
    """Work out rank, world size and rendezvous address from flags or the launcher's env.

    Explicit ``rank`` (a manual multi-node start) wins over any environment; explicit
    ``master_addr``/``master_port`` override what a launcher's environment says.
    """
    env = os.environ if env is None else env
    env_addr = env.get("MASTER_ADDR") or None
    env_port = _int(env, "MASTER_PORT")

    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ConfigError("a manual start needs both --rank and --world-size (alias --num-nodes)")
        if not 0 <= rank < world_size:
            raise ConfigError(f"--rank {rank} is outside 0..{world_size - 1} for --world-size {world_size}")
        addr = master_addr or env_addr
        if addr is None and world_size > 1:
            raise ConfigError("a manual start needs --master-addr (alias --master-ip): rank 0's address")
        if addr is not None:
            check_host("--master-addr", addr)  # before the rendezvous waits its whole timeout for it
        return LaunchInfo("manual", rank, world_size, 0, 1, addr or "127.0.0.1",
                          master_port or env_port or DEFAULT_MASTER_PORT)

    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or anything that speaks its language
        world = _int(env, "WORLD_SIZE")
        return LaunchInfo("torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK") or 0,
                          _int(env, "LOCAL_WORLD_SIZE") or world,
                          env_addr or "127.0.0.1", env_port or DEFAULT_MASTER_PORT)

    mpi_rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    if mpi_rank is not None:
        world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        if world is None:
            raise ConfigError("mpirun environment has a rank but no OMPI_COMM_WORLD_SIZE / PMI_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
        addr = master_addr or env_addr
        if addr is None:
            if local_world != world:
                raise ConfigError(
                    "under mpirun across several hosts distlab needs rank 0's address: pass "
                    "--master-addr HOST (or export MASTER_ADDR) to every rank"
                )
            addr = "127.0.0.1"
        return LaunchInfo("mpirun", mpi_rank, world, local_rank or 0, local_world or world,
                          addr, master_port or env_port or DEFAULT_MASTER_PORT)

    in_srun_step = ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_PROCID" in env
    if in_srun_step and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        per_node = re.match(r"\d+", env.get("SLURM_TASKS_PER_NODE", "") or "")
        addr = master_addr or env_addr
        if addr is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
            addr = slurm_first_host(nodelist)
        port = master_port or env_port or 10000 + (_int(env, "SLURM_JOB_ID") or 0) % 20000
        return LaunchInfo("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID") or 0,
                          int(per_node.group()) if per_node else world, addr, port)

    return LaunchInfo("single", 0, 1, 0, 1, master_addr, master_port)


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when this process was started by torchrun, mpirun or srun (so it must not launch)."""
    return detect_launch(env).launcher not in ("single", "manual")


LAUNCHER_PID = "DISTLAB_LAUNCHER_PID"  # set by `distlab ... --nproc-per-node N` for its workers

_ADOPTED: list[int] = []  # a worker forked by a prefork server: the parent torchrun started it under


def adopt_parent(pid: int) -> None:
    """This process is a worker forked by a prefork server (:mod:`distlab.launch.prefork`) for a client that
    ``pid`` (torchrun's agent) started: that is its parent for :func:`parent_pid`, and it already dies with
    the server, which dies with the launcher."""
    _ADOPTED[:] = [pid]


def parent_pid() -> int:
    """The process that started this one as torchrun starts workers: its parent, or for a worker forked by a
    prefork server, its client's parent."""
    return _ADOPTED[0] if _ADOPTED else os.getppid()


def follow_launcher() -> bool:
    """A worker of a distlab launch dies with its launcher: SIGKILL on the parent's death (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so a ``kill -9`` of the command stops the whole job -- no orphaned
    workers go on training and writing beside a restart. True if armed."""
    if _ADOPTED:  # armed at the fork: SIGKILL when the prefork server dies, and it dies with the launcher
        return os.environ.get(LAUNCHER_PID) == str(_ADOPTED[0])
    if os.environ.get(LAUNCHER_PID) != str(os.getppid()) or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError):
        return False
    if os.environ.get(LAUNCHER_PID) != str(os.getppid()):  # the launcher died before the call: go now
        os.kill(os.getpid(), signal.SIGKILL)
    return True


ERROR_LINES = "DISTLAB_ERROR_LINES"  # where the workers of `distlab ... --nproc-per-node N` keep their error line


def keep_error_line(rank: int, line: str, said: bool) -> None:
    """A worker of a distlab launch keeps the one line of the error it stops on where its launcher
    reads it (``$DISTLAB_ERROR_LINES``), and whether it has printed it. An error every rank meets is
    printed by rank 0 alone -- but the rank that gets there first exits first, and torchrun's agent then
    stops the others, rank 0 perhaps before it printed: the launcher then prints a kept line itself
    (:func:`unsaid_error_line`). Nothing outside such a launch; a failed write is not the user's error."""
    directory = os.environ.get(ERROR_LINES)
    if not directory:
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    path = Path(directory) / f"attempt-{attempt:04d}-rank-{rank:06d}.json"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"line": line, "said": said}))
        os.replace(tmp, path)  # whole or absent, for a launcher reading while it is stopped
    except OSError:
        pass


def unsaid_error_line(directory: str | Path) -> str | None:
    """The launcher's half of :func:`keep_error_line`: the lowest rank's line of the last attempt, if
    no worker of that attempt printed its own; else None."""
    kept = {}
    for path in Path(directory).glob("attempt-*-rank-*.json"):
        _, attempt, _, rank = path.stem.split("-")
        try:
            kept[int(attempt), int(rank)] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    if not kept:
        return None
    last = max(attempt for attempt, _ in kept)
    lines = [kept[key] for key in sorted(kept) if key[0] == last]
    return None if any(entry.get("said") for entry in lines) else lines[0].get("line")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (racy by nature; use it at once)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """True if something already listens on ``host:port`` (so rank 0 could not bind it). Connections
    of an earlier job still in TIME_WAIT do not count: the store binds with SO_REUSEADDR too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_host(flag: str, host: str) -> None:
    """``host`` is an address or a name this machine resolves -- one line otherwise, at once (a malformed
    address, 127.0.0.1000, waited out the whole rendezvous timeout and then "could not reach" it)."""
    import ipaddress
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(f"{flag} {host!r} is not an IPv4 address (four numbers 0-255 separated by dots)") \
                from None
    try:
        socket.getaddrinfo(host.strip("[]"), None)
    except (OSError, UnicodeError):
        raise ConfigError(f"{flag} {host!r}: no such host (give a name or address this machine resolves)") from None

