"""Asynchronous snapshots (``--snapshot-async``): the run's state copied to host memory at the step
(:func:`host_copy`) and written on a thread of its own (:class:`AsyncWriter`) while training goes on."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.train import snapshot
from distlab.train.config import TrainConfig


def host_copy(obj):
    """``obj`` with every tensor copied to host memory (detached) and every container copied: what the
    training may change from the next step on is not shared with a snapshot being written."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class AsyncWriter:
    """Writes snapshots on a thread of its own (``--snapshot-async``), as DCP's ``async_save`` does: the
    same files, checksums, atomic rename and pruning as a synchronous snapshot (:func:`snapshot.save`),
    whose few collectives run on a process group of their own, beside the training's. One write at a
    time; a process killed mid-write leaves the previous snapshot as it was."""

    def __init__(self, cfg: TrainConfig):
        import threading
        self.cfg, self._threading = cfg, threading
        # every rank makes the group at the same point (collective); gloo: the host copies travel on the CPU
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() and dist.get_world_size() > 1 else None
        self._thread = None
        self._result: dict = {}

    def start(self, step: int, payload: dict, meta: dict) -> None:
        def write() -> None:
            try:
                self._result["path"] = str(snapshot.save(self.cfg.snapshot_dir, step, payload, meta,
                                                         self.cfg.keep_snapshots, group=self.group))
            except BaseException as exc:  # noqa: BLE001 -- handed to the training thread by wait()
                self._result["error"] = exc
        self._result = {}
        self._thread = self._threading.Thread(target=write, name=f"distlab-snapshot-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> str | None:
        """The path of the snapshot being written once it is (None: none was); its error raised here."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if "error" in self._result:
            raise self._result["error"]
        return self._result.get("path")
