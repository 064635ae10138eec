"""Process runtime: who am I, who are my peers, which device and backend, and how we print.

One process per device. ``init()`` reads the launcher's environment (torchrun, mpirun, Slurm) or
explicit flags for a manual multi-node start, picks a backend (NCCL with CUDA, else gloo), starts
the default process group with a bounded timeout and returns a frozen :class:`Runtime`. Nothing
here is a module-level global: functions that communicate take a ``group``.

Launchers and the variables read (first match wins):

==========  ==============================================================================
manual      ``--rank R --world-size W --master-addr A --master-port P`` on every machine
            (also spelled ``--num-nodes W --master-ip A``, one process per machine)
torchrun    ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT``
mpirun      ``OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK/_LOCAL_SIZE`` (Open MPI) or
            ``PMI_RANK PMI_SIZE MPI_LOCALRANKID`` (MPICH, Intel MPI); rendezvous over TCP at
            ``MASTER_ADDR`` (or ``--master-addr``), since pip builds of PyTorch have no MPI
slurm       ``SLURM_PROCID SLURM_NTASKS SLURM_LOCALID`` inside an ``srun`` step; the master is
            the first host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``
single      none of the above: one process, world size 1
==========  ==============================================================================
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import ipaddress
import os
import random
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from distlab.errors import ConfigError, DistributedError, RankConfigError, first_line

DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT_S = 300.0
BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEVICES = ("auto", "cpu", "cuda")


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


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job, its device and backend. Immutable; pass it around."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    threads: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# --------------------------------------------------------------------------- detection


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


def follow_launcher() -> bool:
    """A worker of a distlab launch dies with its launcher: SIGKILL on the parent's death (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so a ``kill -9`` of the command stops the whole job -- no orphaned
    workers go on training and writing beside a restart. True if armed."""
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


# --------------------------------------------------------------------------- backend + device


def hide_gpus(env=None) -> None:
    """A run decided to be on CPU: hide the GPUs from this process and every process it starts
    (``CUDA_VISIBLE_DEVICES=""``), so torch's own defaults -- the device type of a DeviceMesh that
    FSDP2 builds, DDP communication hooks that synchronize CUDA -- see the device distlab's side uses.
    Takes effect in processes that have not touched CUDA yet (workers, spawned ranks)."""
    (os.environ if env is None else env)["CUDA_VISIBLE_DEVICES"] = ""


def resolve_device(device: str, local_rank: int) -> torch.device:
    if device not in DEVICES:
        raise ConfigError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but PyTorch sees no CUDA device; use --device cpu")
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RankConfigError(
                f"local rank {local_rank} has no GPU: this host has {count}; start at most {count} "
                f"processes per node (--nproc-per-node {count})"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_local_devices(device: str, nproc_per_node: int) -> None:
    """Before launching: refuse more local ranks than GPUs when the ranks will use CUDA."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if nproc_per_node > count:
            raise ConfigError(
                f"--nproc-per-node {nproc_per_node} but this host has {count} GPU(s) and each rank needs its "
                f"own: use --nproc-per-node {count}, or --device cpu for CPU ranks with gloo")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> NCCL on CUDA, gloo on CPU; refuse what this PyTorch cannot do, naming the fix."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        if device.type != "cuda":
            raise ConfigError("--backend nccl needs CUDA tensors; with --device cpu use --backend gloo")
        if not dist.is_nccl_available():
            raise ConfigError("this PyTorch build has no NCCL; use --backend gloo")
    if backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError(
            "this PyTorch build has no MPI backend (pip wheels never do). To run under mpirun, use "
            "--backend gloo (or auto): distlab reads the OMPI_COMM_WORLD_* / PMI_* variables and meets "
            "its peers over TCP at --master-addr, e.g. "
            "`mpirun -n 4 distlab train --backend gloo --master-addr HOST0 ...`"
        )
    if backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError("this PyTorch build has no gloo backend")
    return backend


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else ("lo0" if "lo0" in names else None)


def _is_loopback(host: str | None) -> bool:
    if host in (None, "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- init


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _meet(info: LaunchInfo, timeout_s: float, every_s: float = 10.0, say=_say) -> dist.Store:
    """Bring every rank together at ``MASTER_ADDR:MASTER_PORT`` and return the store they share.

    Rank 0 hosts a TCP store there; the others connect to it. Every ~``every_s`` seconds a rank
    that still waits says so (rank 0: how many ranks are missing; the others: that rank 0 is not
    up yet), and after ``timeout_s`` seconds in all start-up fails naming who was missing.
    """
    where = f"{info.master_addr}:{info.master_port}"
    deadline = time.monotonic() + timeout_s
    if info.rank == 0:
        store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    else:
        while True:
            left = deadline - time.monotonic()
            try:  # at least 1 s: torch < 2.5 cuts a client's timeout to whole seconds (0.5 -> 0: never connects)
                store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=False,
                                      timeout=datetime.timedelta(seconds=max(1.0, min(every_s, left))))
                break
            except (dist.DistError, RuntimeError) as exc:
                if deadline - time.monotonic() <= 0:
                    raise DistributedError(
                        f"rank {info.rank} could not reach rank 0 at {where} within {timeout_s:g}s "
                        f"({_first_line(exc)}); check that rank 0 is running and that {info.master_addr} is "
                        f"reachable from this host, or raise --init-timeout") from None
                say(f"distlab: rank {info.rank}: waiting for rank 0 at {where} "
                    f"({deadline - time.monotonic():.0f}s of the start-up timeout left)")
    arrived = store.add("distlab/arrived", 1)
    said = time.monotonic()
    while arrived < info.world_size:
        now = time.monotonic()
        if now >= deadline:
            raise DistributedError(
                f"rank {info.rank} waited {timeout_s:g}s at {where} but only {arrived} of {info.world_size} ranks "
                f"joined: start every rank with the same --master-addr/--master-port and world size, or raise "
                f"--init-timeout")
        if info.rank == 0 and now - said >= every_s:
            say(f"distlab: waiting for {info.world_size - arrived} of {info.world_size} ranks at {where} "
                f"({deadline - now:.0f}s of the start-up timeout left)")
            said = now
        time.sleep(0.05)
        arrived = store.add("distlab/arrived", 0)
    return store


def _first_line(exc: BaseException) -> str:
    """An exception's first line without c10d's internal store keys."""
    text = first_line(exc, 10**6)
    return re.sub(r",?\s*keys?:\s.*$", "", text)[:300]


def _explain_init_failure(exc: Exception, info: LaunchInfo, timeout_s: float) -> DistributedError:
    msg = _first_line(exc)
    where = f"{info.master_addr}:{info.master_port}"
    if "EADDRINUSE" in msg or "address already in use" in msg.lower():
        return DistributedError(
            f"port {info.master_port} on {info.master_addr} is already in use; pick a free one with "
            f"--master-port (another job may be running there)"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", msg)
    if joined:
        return DistributedError(
            f"rank 0 waited {timeout_s:g}s at {where} but only {joined.group(1)} of {info.world_size} "
            f"ranks joined: start every rank with the same --master-addr/--master-port and world size, "
            f"or raise --comm-timeout"
        )
    if "timed out" in msg.lower() or "connect" in msg.lower():
        return DistributedError(
            f"rank {info.rank} could not reach rank 0 at {where} within {timeout_s:g}s ({msg}); check "
            f"that rank 0 is running and that {info.master_addr} is reachable from this host"
        )
    return DistributedError(f"rank {info.rank} failed to join the process group at {where}: {msg}")


def init(
    *,
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    init_timeout_s: float | None = None,
    threads: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Runtime:
    """Start the default process group for this process and return its :class:`Runtime`.

    ``timeout_s`` is the group's timeout for every collective. Start-up has its own,
    ``init_timeout_s`` (default: the same): a peer that never arrives makes every rank fail with
    :class:`DistributedError` after it, and the ranks that wait say so every ~10 s meanwhile.
    """
    follow_launcher()
    info = detect_launch(env, rank=rank, world_size=world_size, master_addr=master_addr,
                         master_port=master_port)
    dev = resolve_device(device, info.local_rank)
    backend = resolve_backend(backend, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    threads = threads or max(1, cores() // max(1, info.local_world_size))
    torch.set_num_threads(threads)

    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        raise DistributedError("the default process group is already initialised in this process")
    try:
        if info.world_size == 1:
            # Nothing to meet: an in-memory store, no port opened.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
                if info.local_world_size == info.world_size and _is_loopback(info.master_addr):
                    # Everyone is on this host: keep gloo's sockets on loopback.
                    lo = _loopback_ifname()
                    if lo:
                        os.environ["GLOO_SOCKET_IFNAME"] = lo
            if info.launcher == "torchrun":
                # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT and keeps it across
                # restarts of the worker group; each attempt gets its own key prefix, or a restarted
                # group would read the dead group's addresses (gloo then waits on ports nobody listens on).
                # Without the agent (torchrun-style variables set by something else), rank 0 hosts it.
                environ = os.environ if env is None else env
                attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                                      is_master=not agent and info.rank == 0, timeout=timeout)
                # A store rank 0 hosts is new each attempt (and a node that joined an elastic job later
                # counts its restarts from 0): no attempt in the prefix, or the nodes would never meet.
                store = dist.PrefixStore(f"distlab/attempt-{attempt}" if agent else "distlab/group", store)
            else:
                store = dist.PrefixStore("distlab/group", _meet(info, init_timeout_s or timeout_s))
            dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                                    timeout=timeout)
            global _STORE
            _STORE = (store, f"{info.master_addr}:{info.master_port}")
    except (dist.DistError, RuntimeError, ValueError) as exc:
        raise _explain_init_failure(exc, info, init_timeout_s or timeout_s) from exc
    return Runtime(info.rank, info.world_size, info.local_rank, info.local_world_size, dev,
                   backend, info.launcher, threads)


def from_process_group(device: torch.device | None = None) -> Runtime:
    """A :class:`Runtime` for a process whose default group someone else started."""
    if not dist.is_initialized():
        raise DistributedError("no process group: call distlab.runtime.init() first")
    world = dist.get_world_size()
    return Runtime(dist.get_rank(), world, 0, world, device or torch.device("cpu"),
                   dist.get_backend(), "external", torch.get_num_threads())


_COMM_FAILURE_MARKERS = ("gloo", "nccl", "connection reset", "connection closed", "connection refused",
                         "timed out", "timeout", "broken pipe", "socket")


def is_comm_failure(exc: BaseException) -> bool:
    """True if ``exc`` is a collective failing because a peer died, hung or became unreachable."""
    if isinstance(exc, dist.DistError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(marker in text for marker in _COMM_FAILURE_MARKERS)
    return False


_STORE: tuple[dist.Store, str] | None = None  # the job's store and its address (roll_call names it)


def roll_call(tag: str, window_s: float = 3.0) -> tuple[list[int] | None, str | None]:
    """After a collective failed: which ranks still answer through the job's store (the rendezvous's
    key-value store, reached over its own TCP connection, not gloo's) within ``window_s`` seconds.

    Every rank that runs it writes ``tag``/its rank, then waits for the others' keys. Returns
    ``(missing ranks, None)``, or ``(None, why)`` when this rank cannot reach the store itself (its
    node is the one cut off, or the store's host is gone); ``(None, None)`` without a store to ask. Store calls on a dead link block in C++
    for the store's own timeout, so they run on a daemon thread that is abandoned after the window.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [], None
    import threading
    try:
        store = dist.distributed_c10d._get_default_store()  # the store the default group met through
    except (RuntimeError, ValueError, AttributeError):
        return None, None
    address = _STORE[1] if _STORE is not None else "its address"
    rank, world = dist.get_rank(), dist.get_world_size()
    answer: dict = {}

    def call() -> None:
        try:
            store.set(f"roll-call/{tag}/{rank}", "1")
            deadline = time.monotonic() + window_s
            while True:
                missing = [r for r in range(world) if not store.check([f"roll-call/{tag}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    answer["missing"] = missing
                    return
                time.sleep(0.1)
        except Exception as exc:  # the store's host is gone or unreachable  # noqa: BLE001
            answer["error"] = f"{type(exc).__name__}: {first_line(exc, 10**6)}"

    thread = threading.Thread(target=call, name="distlab-roll-call", daemon=True)
    thread.start()
    thread.join(window_s + 2.0)
    if "missing" in answer:
        return answer["missing"], None
    return None, (f"this rank cannot reach the job's store at {address} either ("
                  f"{answer.get('error') or f'no answer in {window_s + 2.0:g} s'})")


_AT_SHUTDOWN: list = []  # what shutdown() calls before destroying the group (most recent first)


def at_shutdown(release) -> None:
    """Have :func:`shutdown` call ``release()`` before it destroys the process group (once, however
    often it is registered): for what holds gloo connections torch does not know about."""
    if release not in _AT_SHUTDOWN:
        _AT_SHUTDOWN.append(release)


def shutdown() -> None:
    """Leave the job: free what still holds the group (DDP reducers, gloo work) before destroying it.

    Without the collect, a DDP model in a reference cycle outlives the group and is torn down during
    interpreter exit, where gloo occasionally aborts the process ("terminate called without an
    active exception": 2 of 32 two-rank DDP runs here before, 0 of 30 with it). What registered with
    :func:`at_shutdown` goes first, for the same reason (the duplex partners of distlab's
    point-to-point collectives: :func:`distlab.comm.p2p.release`).
    """
    if dist.is_initialized():
        gc.collect()
        for release in reversed(_AT_SHUTDOWN):
            release()
        dist.destroy_process_group()


def leave(code: int = 0) -> None:
    """The end of a finished job on a rank of several: once every rank has arrived (a barrier, within
    the group's timeout) nothing is left to lose, so the output is flushed and the process exits at
    once, without tearing down the group or the interpreter -- as launchers' workers do (``os._exit``).
    In that teardown gloo's threads occasionally abort a finished process ("terminate called without
    an active exception", SIGABRT: a complete 2-rank run reported as failed, once in a loaded suite),
    and nothing of a finished run needs it. One process, or no group: returns (the caller exits as usual)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    dist.barrier()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(code)


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


# --------------------------------------------------------------------------- same model everywhere


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) so model construction is reproducible."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s (one broadcast per tensor); a
    parameter replicated over a group of its own (``sync_group``, an expert shard) only by that group."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for tensor in list(module.parameters()) + list(module.buffers()):
        if getattr(tensor, "sync_group", group) is not group:
            continue
        dist.broadcast(tensor.data, src=dist.get_global_rank(group, src) if group else src, group=group)


# --------------------------------------------------------------------------- lookups


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (default: the world); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); 0 without a process group."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def reduce_scalars(values: list[float], op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None,
                   device: torch.device | str = "cpu") -> list[float]:
    """Reduce a few numbers across ``group`` (default: the world) in one float64 collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


MMAP_THRESHOLD = 32 << 20   # glibc's largest: blocks up to this come from the heap and are reused
TRIM_THRESHOLD = 128 << 20  # free memory the heap keeps before it gives any back to the OS


def tune_host_allocator() -> str | None:
    """Keep a training step's host-memory blocks in the process instead of mapping and unmapping
    them every step. glibc serves blocks of 128 KiB and more with ``mmap`` until its dynamic
    threshold has seen one that size freed, and gives the heap's free top back to the OS: a CPU
    step's activations (MiBs each) are then page-faulted in anew every step. Measured on the GPT in
    bf16 on 2 cores: 80 ms per step before, 72 ms with these settings -- what a loop that happened to
    free one large tensor first gets by luck. ``mallopt`` with fixed thresholds (32 MiB, the most
    glibc allows, and a 128 MiB trim threshold) makes it so by design. Linux with glibc only; a
    no-op elsewhere or with ``DISTLAB_MALLOC_TUNE=0``. Returns what it set, or None."""
    if os.environ.get("DISTLAB_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return None
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    if mallopt(m_mmap_threshold, MMAP_THRESHOLD) != 1 or mallopt(m_trim_threshold, TRIM_THRESHOLD) != 1:
        return None
    return f"glibc malloc: blocks up to {MMAP_THRESHOLD >> 20} MiB reused, {TRIM_THRESHOLD >> 20} MiB kept before trimming"


def cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


LOAD_AT_LAUNCH = "DISTLAB_LOAD_AT_LAUNCH"  # the launcher's reading of the load, before its workers start


def load_before_run() -> float | None:
    """The machine's 1-minute load average before this run added to it: what the launching command
    read (``DISTLAB_LOAD_AT_LAUNCH``), else the reading now; None where the OS has none."""
    try:
        return float(os.environ[LOAD_AT_LAUNCH])
    except (KeyError, ValueError):
        pass
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_machine(load: float | None, threads: int, have: int) -> str | None:
    """Why timings on this machine mean less (None: they do not): it was already running ``load``
    (1-minute average) on ``have`` cores, and ``threads`` more would share them."""
    if load is None or load < 0.5 or load + threads <= have:
        return None
    return (f"the machine was busy before this run (load {load:.2f} on {have} cores; with this run's {threads} "
            f"thread(s) the cores are shared), so steps are slower than this machine allows and timings compare "
            f"only between runs at equal threads on an equally quiet machine")


# --------------------------------------------------------------------------- printing


def _rank() -> int:
    return group_rank()


def print0(*args, **kwargs) -> None:
    """``print`` on global rank 0 only (flushed)."""
    if _rank() == 0:
        print(*args, **kwargs, flush=True)


def ordered_print(line: str, group: dist.ProcessGroup | None = None, file=None) -> None:
    """Print one line per rank, in rank order, whatever the scheduling.

    Every rank's line is gathered to the group's first rank, which alone writes them, so the
    output is exactly ``rank 0, 1, ..., n-1`` even though the processes share one terminal.
    Collective: every rank of ``group`` must call it.
    """
    file = file or sys.stdout
    if not dist.is_initialized():
        print(line, file=file, flush=True)
        return
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    lines: list[str] | None = [None] * n if me == 0 else None  # type: ignore[list-item]
    dist.gather_object(str(line), lines, dst=dst, group=group)
    if me == 0:
        file.write("".join(f"{x}\n" for x in lines))
        file.flush()
