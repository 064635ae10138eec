"""``distlab doctor``: what this machine offers for distributed training."""

from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist

from distlab.data import REGISTRY, locate
from distlab.errors import DataNotFoundError
from distlab.runtime import busy_machine, cores


def report(data_dir: str | None = None) -> str:
    lines = [f"distlab doctor on {platform.node()} ({platform.machine()}, Python {platform.python_version()})",
             f"torch {torch.__version__}"]
    lines.append("backends: " + ", ".join(
        f"{name} {'yes' if ok() else 'no'}" for name, ok in
        (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available), ("mpi", dist.is_mpi_available))))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("cuda: no devices (training runs on CPU with gloo)")
    usable = cores()
    lines.append(f"cores: {os.cpu_count()} ({usable} usable by this process); torch threads {torch.get_num_threads()}")
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    if load is not None:
        busy = busy_machine(load, usable, usable)  # a one-process run's default: every core
        lines.append(f"load: {load:.2f} (1-minute average) on {usable} cores" + (
            f" -- busy: {busy.split(', so ', 1)[1].replace('pass --threads', 'a run of one process: pass --threads')}"
            f"; a run's default is {usable} // ranks threads per rank, which these cores are already running for "
            f"others" if busy else ": quiet enough for timings"))
    for name in REGISTRY:
        try:
            lines.append(f"dataset {name}: {locate(name, data_dir)}")
        except DataNotFoundError as exc:
            lines.append(f"dataset {name}: missing -- {exc}")
    return "\n".join(lines)
