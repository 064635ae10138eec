"""Offload (``--offload optimizer|params``): the optimizer's state -- and under ZeRO-3 the parameter shards -- held
off the device, brought in for the moment they are used, and let go again: ZeRO-Offload's and ZeRO-Infinity's
tiers, FSDP's ``cpu_offload``.

Where they live (:class:`OffloadStore`):

- **host memory**, pinned, when the model is on a GPU: each parameter's step runs on the CPU (its gradient copied
  to the host, the parameter copied back: :func:`stepped_off_device`), the device holding no moments at all;
- **a file on disk** (``--offload-dir DIR``, one file a rank), memory-mapped: on a CPU, where the host *is* the
  device, the only place "off the device" can be, and ZeRO-Infinity's NVMe tier on a GPU. Each tensor is a
  page-aligned region of the file, reserved on disk when it is made (``posix_fallocate``: a full disk is an error
  at once, not a crash mid-step). After a tensor is used its pages are dropped from the process
  (``madvise(MADV_DONTNEED)``): they stay in the file (and the kernel's page cache, reclaimable under pressure,
  written back when it chooses), so a rank's resident memory holds one parameter's state at a time, not all of it.

What a step moves: per parameter of ``N`` elements, the moments read and written (``2 x 2 x 4 N`` bytes in float32,
half in bfloat16); with ``params``, the shard read at each gather and read and written by its step, and the shard's
reduced gradient written once and read by the step (ZeRO-Infinity's gradient offload: only a unit's full gradient,
while it is reduced, is on the device). The planner
prices those bytes over the host link or the disk (:mod:`distlab.plan`). Nothing in the step itself overlaps them
with compute: the optimizer step waits for its state, as ``pytorch#74588`` measured (``docs/16-memory.md``);
``--offload-overlap`` runs the whole step beside the next step's forward instead (:mod:`distlab.parallel.step_ahead`).

The file is scratch, not a snapshot: snapshots hold the state as they always do (read from the file), and a
resumed run fills a fresh file from its snapshot. Two runs writing one file would corrupt each other, so each
rank's file is locked while a run holds it (``flock``): a second run on the same directory is refused, and a
stale file from a run that ended (or died) is replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import weakref
from pathlib import Path

import torch

from distlab.errors import ConfigError

MODES = ("none", "optimizer", "params")

_OFF_DEVICE: set[int] = set()  # the storages (by address) that live in a store: not the device's memory


def off_device(storage_key: int) -> bool:
    """Whether the storage at ``storage_key`` lives in an :class:`OffloadStore` (state bytes leave it out)."""
    return storage_key in _OFF_DEVICE


def check_offload(mode: str, directory: str | None, zero: int, device_type: str | None) -> None:
    """What ``--offload`` needs: a mode it knows, ZeRO-3 for the parameters (the others hold every parameter
    whole on the device, where the forward reads it), and off a GPU a directory (on a CPU the host is the
    device; ``device_type`` None: not known yet, checked when it is)."""
    if mode not in MODES:
        raise ConfigError(f"unknown `offload` {mode!r}; choose one of: {', '.join(MODES)}")
    if mode == "none":
        if directory:
            raise ConfigError("`offload_dir` names where offloaded state goes: give --offload optimizer or params "
                              "too, or drop --offload-dir")
        return
    if mode == "params" and zero != 3:
        raise ConfigError(f"--offload params holds ZeRO-3's parameter shards off the device; with "
                          f"{f'--zero {zero}' if zero else 'no --zero'} every rank holds each parameter whole, "
                          f"where the forward reads it: add --zero 3, or offload the optimizer (--offload optimizer)")
    if device_type == "cpu" and not directory:
        raise ConfigError(f"--offload {mode} on a CPU: the host is the device, so the state goes to a file on disk: "
                          f"give --offload-dir DIR (a local disk with room for it; `distlab plan` says how much)")
    if mode == "params" and device_type == "cuda":
        raise ConfigError("--offload params on a GPU: not built (the shards would stream in over the host link "
                          "before each gather); offload the optimizer (--offload optimizer), which steps on the host")


def check_unused(directory: str | None) -> None:
    """Before launching: no live run holds an offload file in ``directory`` (each rank's is locked while in use)."""
    for path in sorted(Path(directory).glob("rank*.bin")) if directory and Path(directory).is_dir() else []:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{path} is in use by another run: give each run its own --offload-dir") from None
        finally:
            os.close(fd)


class OffloadStore:
    """One rank's offloaded tensors: regions of ``directory/rank{R}.bin`` (memory-mapped), or pinned host memory
    (``directory`` None; on a machine with a GPU)."""

    def __init__(self, directory: str | Path | None, rank: int):
        self.directory = Path(directory) if directory else None
        self.nbytes = 0  # bytes held (the file's size: every region page-aligned)
        self.payload = 0  # bytes of the tensors themselves
        self._maps: dict[int, mmap.mmap] = {}  # storage key -> its region's mapping
        self._pinned: list[torch.Tensor] = []
        self._fd = None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path = self.directory / f"rank{rank}.bin"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(f"{self.path} is in use by another run: give each run its own --offload-dir") \
                    from None
            os.ftruncate(fd, 0)  # a stale file (a run that ended or died): its contents mean nothing now
            self._fd = fd
        self._finalizer = weakref.finalize(self, OffloadStore._close, self._fd, self._maps, self._pinned)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` held here, its values undefined (zeros in a fresh file region)."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        self.payload += nbytes
        if self.directory is None:
            t = torch.empty(shape, dtype=dtype, pin_memory=True)
            self._pinned.append(t)
            self.nbytes += nbytes
            _OFF_DEVICE.add(t.untyped_storage().data_ptr())
            return t
        length = -(-nbytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        try:
            os.posix_fallocate(self._fd, self.nbytes, length)
        except OSError as exc:
            raise ConfigError(f"--offload-dir {self.directory}: no room for {length / 2**20:.1f} MiB more of "
                              f"offloaded state ({exc.strerror}; {self.nbytes / 2**30:.2f} GiB held so far): free "
                              f"space there or choose another directory") from None
        region = mmap.mmap(self._fd, length, offset=self.nbytes)
        self.nbytes += length
        t = torch.frombuffer(region, dtype=dtype, count=numel).view(shape)
        key = t.untyped_storage().data_ptr()
        self._maps[key] = region
        _OFF_DEVICE.add(key)
        return t

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = self.empty(shape, dtype)
        if self.directory is None:  # (a fresh file region reads as zeros already)
            t.zero_()
        return t

    def holding(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` held here (its pages let go: :meth:`release`)."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        self.release(out)
        return out

    def holds(self, t: torch.Tensor | None) -> bool:
        return t is not None and off_device(t.untyped_storage().data_ptr())

    def release(self, t: torch.Tensor | None) -> None:
        """Drop ``t``'s pages from this process (a file region: written back to the file by the kernel, read
        again from it at the next touch); host memory stays where it is."""
        if t is None:
            return
        region = self._maps.get(t.untyped_storage().data_ptr())
        if region is not None:
            region.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _close(fd, maps, pinned) -> None:
        for key in list(maps) + [t.untyped_storage().data_ptr() for t in pinned]:
            _OFF_DEVICE.discard(key)
        maps.clear()  # (a mapping a tensor still views closes when the tensor goes)
        pinned.clear()
        if fd is not None:
            os.close(fd)  # (the lock with it)


@contextlib.contextmanager
def stepped_off_device(store: OffloadStore | None, param: torch.Tensor, state: dict, grad: torch.Tensor | None):
    """Where one parameter's optimizer step runs: yields ``(param, grad)`` to step in place. Without a store the
    parameter itself; with one, on the host -- a GPU parameter and its gradient copied there and the parameter
    copied back after -- and then the pages of its state (and of the parameter, a ZeRO-3 shard held in the
    store) let go. ``grad``: the parameter's gradient, as it was when the step was launched."""
    if store is None:
        yield param, grad
        return
    on_host = param.device.type == "cpu"
    host = param if on_host else param.detach().to("cpu")
    grad = grad if on_host or grad is None else grad.to("cpu")
    try:
        yield host, grad
        if not on_host:
            param.copy_(host, non_blocking=True)
    finally:
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim():
                store.release(t)
        if on_host:
            store.release(param)
            store.release(grad)



def no_shards(sync) -> ConfigError:
    """What a gradient sync without ZeRO-3's shards says to ``--offload params``."""
    return ConfigError(f"--offload params moves ZeRO-3's parameter shards; {type(sync).__name__} holds every "
                       f"parameter whole: use --zero 3 (the tuned ZeRO), or --offload optimizer")
