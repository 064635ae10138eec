"""Where a rank runs: its device and backend (NCCL with CUDA, else gloo; GPUs hidden on request),
the loopback interface gloo binds to on one machine, the host allocator, the cores and the load
before a run (:func:`busy_machine`: a machine too busy for its timings to mean much)."""

from __future__ import annotations

import ctypes
import datetime
import ipaddress
import os
import platform
import re
import socket
import sys

import torch
import torch.distributed as dist

from distlab.errors import ConfigError, RankConfigError

BACKENDS = ("auto", "gloo", "nccl", "mpi")


DEVICES = ("auto", "cpu", "cuda")


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


def loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else ("lo0" if "lo0" in names else None)


def is_loopback(host: str | None) -> bool:
    if host in (None, "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def load_stretch() -> float:
    """How many times slower than on an idle machine work may run here now: the 1-minute load average
    per core, at least 1. Hang guards (:func:`~distlab.launch.spawn.run_ranks`, the test suite's
    subprocesses) stretch their deadlines by it, so a busy machine is not taken for a hung one."""
    try:
        return max(1.0, os.getloadavg()[0] / cores())
    except (AttributeError, OSError):
        return 1.0


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


def busy_machine(load: float | None, threads: int, have: int, ranks: int = 1) -> str | None:
    """Why timings on this machine mean less (None: they do not): it was already running ``load``
    (1-minute average) on ``have`` cores, and ``threads`` more -- ``ranks`` processes' worth -- would
    share them; with the ``--threads`` per rank that would fit beside the load, or, where even one
    thread a rank would not, that it is the machine, not the layout."""
    if load is None or load < 0.5 or load + threads <= have:
        return None
    fit = int((have - load) // ranks)  # threads per rank the free cores hold
    per_rank = max(1, threads // ranks)
    advice = (f"pass --threads {fit} ({ranks} rank{'s' if ranks > 1 else ''} x {fit} beside the load fit the "
              f"{have} cores)" if 1 <= fit < per_rank else
              "even 1 thread per rank shares the cores: time on a quieter machine, or with fewer ranks")
    return (f"the machine was busy before this run (load {load:.2f} on {have} cores; with this run's {threads} "
            f"thread(s) the cores are shared), so steps are slower than this machine allows (a rank whose threads "
            f"wait for busy cores can run many times slower) and timings compare only between runs at equal "
            f"threads on an equally quiet machine; {advice}")


# Dense peak TFLOP/s of the GPUs distlab knows, per device (tensor cores for bf16/fp16; fp32 as torch
# runs it by default, without TF32), from the vendors' data sheets (SXM parts where there are several).
PEAK_TFLOPS = {"H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
               "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
               "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
               "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
               "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
               "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
               "V100": {"fp16": 125.0, "fp32": 15.7}}


def peak_tflops(device: torch.device, precision: str = "fp32") -> tuple[float | None, str]:
    """(The device's dense peak TFLOP/s at ``precision``, where it comes from); (None, why) for a CPU or
    a GPU not in :data:`PEAK_TFLOPS` -- give ``--peak-tflops`` there."""
    if device.type != "cuda":
        return None, "a CPU has no known peak: give --peak-tflops for MFU"
    return peak_of(torch.cuda.get_device_name(device), precision)


def peak_of(name: str, precision: str) -> tuple[float | None, str]:
    """:func:`peak_tflops` of a GPU by its name (``NVIDIA A100-SXM4-80GB``)."""
    plain = name.upper().replace("NVIDIA", " ")
    for model in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "A100" before "A10", "L40S" before "L4"
        if re.search(rf"(?<![A-Z0-9]){model}(?![0-9])", plain):
            peak = PEAK_TFLOPS[model].get(precision)
            if peak is not None:
                return peak, f"{name}: {peak:g} dense {precision} TFLOP/s (data sheet)"
    return None, f"{name}: no known {precision} peak: give --peak-tflops for MFU"


def machine_facts() -> dict:
    """Where and when a record was made: torch, host, cores, date (UTC)."""
    return {"cores": cores(), "torch_version": torch.__version__, "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
