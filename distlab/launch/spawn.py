"""Start N local ranks and run a function on them: ``verify``, the benches, library users and tests.

Commands a user runs start their workers through torchrun (:mod:`distlab.launch.torchrun`); this module
is for code that wants results back in the calling process -- an equivalence check, a benchmark,
a test -- without a command line in between.

``run_ranks(fn, n, *args)`` spawns ``n`` processes; each joins a process group (rendezvous through
a TCP store that this process hosts on a free port, so there is no port race), calls
``fn(rank, n, *args)`` and sends back its return value. Any rank's exception is re-raised here
with the rank named and its traceback; a rank still running after ``timeout`` seconds (a hang)
is killed and reported as such. The process group's own timeout is the same, so a collective
whose peer died raises instead of waiting forever.

Processes start from a *fork server* (Linux) that has imported torch and distlab once: a rank
costs ~0.05 s to start instead of the ~2 s of a fresh interpreter importing torch, which is most
of a small equivalence test. Each rank is still a clean process -- the server imports modules and
runs nothing, so no thread pool or device exists before the fork -- and it gets the caller's
current environment, working directory and ``sys.path`` (the server's are those of its start).
``DISTLAB_SPAWN=spawn`` (or another platform) starts fresh interpreters instead.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distlab.runtime.device import load_stretch


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds each rank's story."""

    @property
    def config_error(self) -> str | None:
        """The first rank's :class:`~distlab.errors.ConfigError` message, where a rank failed on one."""
        return next((line.partition(": ")[2] for line in str(self).splitlines()
                     if line.startswith("distlab.errors.ConfigError: ")), None)


# torch._dynamo: see distlab.launch.prefork.PRELOAD
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "distlab.launch.spawn", "distlab.train", "distlab.parallel",
           "distlab.launch.frozen"]  # last: the heap all of them made, frozen out of the collector


def _context():
    """The fork server (Linux; its imports are preloaded once per calling process) or plain spawn."""
    method = os.environ.get("DISTLAB_SPAWN", "forkserver" if sys.platform == "linux" else "spawn")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"DISTLAB_SPAWN={method!r}: use forkserver or spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world_size: int, port: int | None, fn: Callable, args: tuple, kwargs: dict,
            env: Mapping[str, str] | None, results, timeout: float, backend: str, threads: int,
            pg_timeout: float, parent_env: Mapping[str, str], gpus: bool) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(parent_env)
    if not gpus:  # CPU ranks: torch's defaults must not pick a GPU either (runtime.hide_gpus)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(env or {})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        if port is not None:
            store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=timeout))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
            # Every rank through start-up before any goes on: a rank whose function returns at once
            # would otherwise close its sockets while a slower peer is still connecting to them, and
            # that peer's start-up fails ("Connection closed by peer") -- seen under load.
            store.set(f"distlab/spawn/started/{rank}", "1")
            store.wait([f"distlab/spawn/started/{r}" for r in range(world_size)])
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 60.0,
              envs: Sequence[Mapping[str, str]] | None = None, init_group: bool = True,
              backend: str = "gloo", threads: int = 1, pg_timeout: float | None = None,
              gpus: bool = False, **kwargs) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return their results.

    ``fn`` must be importable by name (a module-level function). ``envs[r]`` is added to rank
    ``r``'s environment. With ``init_group=False`` the processes start no process group (for
    testing code that starts its own). ``pg_timeout`` (default ``timeout``) is the process
    group's timeout for every collective. The ranks see no GPU unless ``gpus`` (one device decision
    for the run: torch's own code in a rank then defaults to the CPU as distlab's does).

    ``timeout`` is a hang guard for a quiet machine: on a busy one it stretches by the load per core
    (:func:`~distlab.runtime.device.load_stretch`, at the start for the collectives' timeout, and
    whenever the load seen while waiting is higher for the deadline), so slow is not taken for hung.
    """
    start_stretch = load_stretch()
    pg_timeout = (pg_timeout or timeout) * start_stretch
    ctx = _context()
    results = ctx.Queue()
    store = None
    port = None
    if init_group:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=timeout * start_stretch),
                              wait_for_workers=False)
        port = store.port
    procs = [ctx.Process(target=_worker, daemon=True, name=f"distlab-rank{r}",
                         args=(r, world_size, port, fn, args, kwargs, envs[r] if envs else None, results,
                               timeout * start_stretch, backend, threads, pg_timeout, dict(os.environ), gpus))
             for r in range(world_size)]
    for p in procs:
        p.start()

    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    began, stretch = time.monotonic(), start_stretch
    deadline = began + timeout * stretch

    def take(item) -> None:
        rank, ok, payload = item
        if ok:
            done[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload

    try:
        while len(done) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                take(results.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            stretch = max(stretch, load_stretch())  # a machine that got busier: a later deadline
            deadline = began + timeout * stretch
            for r, p in enumerate(procs):
                if r in done or r in errors or p.is_alive():
                    continue
                # Dead: its result, if it sent one, is already in the pipe.
                try:
                    while True:
                        take(results.get(timeout=0.5))
                except queue.Empty:
                    pass
                if r not in done and r not in errors:
                    errors[r] = f"process exited with code {p.exitcode} without reporting a result"
    finally:
        hung = [r for r in range(world_size) if r not in done and r not in errors]
        if not hung and not errors:
            # Every rank reported: let each finish exiting, so its exit handlers release what it
            # holds (a rank killed mid-exit leaves its semaphores to the resource tracker's
            # "leaked semaphore" warning at shutdown).
            grace = time.monotonic() + 10
            for p in procs:
                p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        del store

    if errors or hung:
        parts = [f"--- rank {r} failed:\n{errors[r]}" for r in sorted(errors)]
        if hung:
            parts.append(f"--- ranks {hung} were still running after {timeout * stretch:g}s ({timeout:g}s on a quiet "
                         f"machine, stretched x{stretch:.1f} by its load; a hang) and were killed")
        raise RankFailure(f"{len(errors) + len(hung)} of {world_size} ranks failed\n" + "\n".join(parts))
    return [done[r] for r in range(world_size)]
