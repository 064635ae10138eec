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

The package, one idea per module: :mod:`~distlab.runtime.launch` (launch detection),
:mod:`~distlab.runtime.device` (device, backend, cores and load), :mod:`~distlab.runtime.failure`
(failure diagnosis); this module starts and ends the process group and holds what every rank asks
of it (its group's rank and size, reductions of a few numbers, printing once).
"""

from __future__ import annotations

import datetime
import gc
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from distlab.errors import DistributedError, first_line
from distlab.runtime.device import (BACKENDS, DEVICES, LOAD_AT_LAUNCH, MMAP_THRESHOLD, TRIM_THRESHOLD, busy_machine,
                                    check_local_devices, cores, hide_gpus, is_loopback, load_before_run,
                                    loopback_ifname, resolve_backend, resolve_device, tune_host_allocator)
from distlab.runtime.failure import explain_init_failure, first_line_of, is_comm_failure
from distlab.runtime.launch import (DEFAULT_MASTER_PORT, LAUNCHER_PID, LaunchInfo, detect_launch, follow_launcher,
                                    free_port, port_in_use, slurm_first_host, under_launcher)

DEFAULT_TIMEOUT_S = 300.0


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
                        f"({first_line_of(exc)}); check that rank 0 is running and that {info.master_addr} is "
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
                if info.local_world_size == info.world_size and is_loopback(info.master_addr):
                    # Everyone is on this host: keep gloo's sockets on loopback.
                    lo = loopback_ifname()
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
        raise explain_init_failure(exc, info, init_timeout_s or timeout_s) from exc
    return Runtime(info.rank, info.world_size, info.local_rank, info.local_world_size, dev,
                   backend, info.launcher, threads)


def from_process_group(device: torch.device | None = None) -> Runtime:
    """A :class:`Runtime` for a process whose default group someone else started."""
    if not dist.is_initialized():
        raise DistributedError("no process group: call distlab.runtime.init() first")
    world = dist.get_world_size()
    return Runtime(dist.get_rank(), world, 0, world, device or torch.device("cpu"),
                   dist.get_backend(), "external", torch.get_num_threads())


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



def backend_words(text: str) -> str:
    """A backend's message without its source location and its boilerplate: gloo's ``[.../pair.cc:553]
    Connection closed by peer [127.0.0.1]:8596. This is typically caused by ... GLHF!`` is ``Connection closed
    by peer [127.0.0.1]:8596``."""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text.strip())
    return re.split(r"\.?\s+This is typically caused by", text, maxsplit=1)[0].strip()


def comm_failure(exc: BaseException, rank: int, step: int, snapshot: str | None = None,
                 snapshot_dir: str | None = None) -> DistributedError:
    """The one line a failed collective becomes: the step, the backend's words, who is missing (a roll call
    through the job's store, which does not go through gloo's connections) and what a restart starts from
    (``snapshot``: the run's newest; ``snapshot_dir``: where it keeps them, None where it keeps none).
    ``step``: the step it failed in."""
    first = backend_words(first_line(exc))
    missing, cut_off = roll_call(f"step-{step}")
    if cut_off:
        who = f"{cut_off}: this rank's node is cut off from the job (its network or the store's host)"
    elif missing:
        names = ", ".join(str(r) for r in missing)
        who = (f"rank{'s' if len(missing) > 1 else ''} {names} did not answer a roll call through the job's "
               f"store: dead, hung or unreachable -- check {'their' if len(missing) > 1 else 'its'} node")
    elif missing is None:
        who = "a peer died, hung or became unreachable -- check the other ranks' messages"
    else:
        who = "every rank answered a roll call through the job's store: a peer hung or its link to this one failed"
    again = (f"a restart resumes from the newest snapshot, {snapshot} (--resume auto)" if snapshot else
             f"no snapshot was written yet: a restart starts the run again" if snapshot_dir else
             "the run keeps no snapshots (--snapshot-dir), so a restart starts it again")
    return DistributedError(f"rank {rank}: communication failed at step {step} ({first[:300]}); {who}; {again}")

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


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) so model construction is reproducible."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s (one broadcast per tensor); a
    parameter replicated over a group of its own (``sync_group``, an expert shard) only by that group.
    A model built on the meta device has nothing to send: every rank gives it the same values later."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    from distlab.runtime.meta import on_meta
    if on_meta(module):
        return
    for tensor in list(module.parameters()) + list(module.buffers()):
        if getattr(tensor, "sync_group", group) is not group:
            continue
        dist.broadcast(tensor.data, src=dist.get_global_rank(group, src) if group else src, group=group)


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


__all__ = ["BACKENDS", "DEFAULT_MASTER_PORT", "DEFAULT_TIMEOUT_S", "DEVICES", "LAUNCHER_PID", "LOAD_AT_LAUNCH",
           "LaunchInfo", "MMAP_THRESHOLD", "Runtime", "TRIM_THRESHOLD", "at_shutdown", "broadcast_module",
           "busy_machine", "comm_failure", "check_local_devices", "cores", "detect_launch", "explain_init_failure", "first_line_of",
           "follow_launcher", "free_port", "from_process_group", "group_rank", "group_size", "hide_gpus", "init",
           "is_comm_failure", "is_loopback", "leave", "load_before_run", "loopback_ifname", "ordered_print",
           "port_in_use", "print0", "reduce_scalars", "resolve_backend", "resolve_device", "roll_call",
           "seed_everything", "shutdown", "slurm_first_host", "tune_host_allocator", "under_launcher"]
