"""``distlab bench snapshot-format``: distlab's snapshot files against ``torch.distributed.checkpoint``.

The question it answers: should distlab's on-disk format be PyTorch's distributed checkpoint
(DCP), which reshards on load? Both write the same state -- one training step into a run, every
rank's model tensors and optimizer state -- from the same processes, into the same directory tree:

* **distlab**: what a run's snapshot writes (:func:`distlab.train.snapshot.save`): one
  ``torch.save`` file per rank, fsynced, a SHA-256 per file in ``meta.json``, committed by an
  atomic rename; loading reads a rank's file, checks its size and checksum and unpickles it with
  ``weights_only=True``.
* **dcp**: ``torch.distributed.checkpoint.save`` / ``load`` with the default planners and
  ``FileSystemWriter`` / ``FileSystemReader`` (one ``.distcp`` file per rank, a pickled
  ``.metadata``). Plain tensors under one key are taken to be replicated: DCP writes them once
  (rank 0). A ZeRO shard of a tensor is not a replica, so sharded entries are keyed per rank;
  DCP loads into the tensors given, in place.

Workloads (``--nproc`` gloo processes, one thread each): ``main`` -- the main job's MLP
(784-512-256-10) under plain data parallel
with SGD + momentum, so every rank holds a full replica; ``wide-mlp-zero3`` -- the 4096x4096 MLP
under ZeRO-3 with Adam, every rank a disjoint shard. Per format: median save and load time over
``--runs`` repetitions (each into a fresh directory; the page cache is warm for loads, as for a
resume on the same machine), bytes on disk and files.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from distlab.bench.common import at_least, choose, format_table, machine, write
from distlab.tools.faults import tensors as _tensors
from distlab.parallel import Strategy
from distlab.train.config import TrainConfig

WORKLOADS = {"main": ("allreduce", (512, 256), "sgd"), "wide-mlp-zero3": ("zero=3", (4096, 4096), "adam")}


def _config(workload: str, dataset: str, nproc: int) -> TrainConfig:
    strategy, widths, optimizer = WORKLOADS[workload]
    return TrainConfig.from_flags(model="mlp", mlp_widths=widths, dataset=dataset, epochs=1, max_steps=1,
                       global_batch_size=16 * nproc, optimizer=optimizer, lr=1e-3, momentum=0.9, seed=0,
                       log_every=1, progress=False, verbose=False, eval_every_epoch=False,
                       strategy=Strategy.parse(strategy)).validate(nproc)


def _size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _dcp_state(trainer, rank: int, sharded: bool) -> dict:
    """The same tensors as the snapshot's, as DCP wants them: nested dicts of tensors (non-tensor
    leaves are pickled by DCP); sharded entries keyed per rank so DCP does not take them for replicas."""
    model = trainer.engine.sharded_state_dict()
    optim = trainer.optimizer.state_dict()
    if sharded:
        return {f"rank{rank}": {"model": model, "optimizer": optim}}
    return {"model": model, "optimizer": optim}


def _measure(rank: int, world: int, cfg: TrainConfig, root: str, runs: int, sharded: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from distlab import runtime
    from distlab.train import Trainer, snapshot, snapshot_load
    trainer = Trainer(cfg, runtime.from_process_group())
    trainer.fit()  # one step: the optimizer state exists
    run = trainer.run
    times: dict[str, list[float]] = {k: [] for k in ("distlab_save", "distlab_load", "dcp_save", "dcp_load")}
    sizes = {}
    for i in range(runs):
        ours, theirs = Path(root) / f"distlab-{i}", Path(root) / f"dcp-{i}"
        run.cfg = dataclasses.replace(run.cfg, snapshot_dir=str(ours), keep_snapshots=1)
        dist.barrier()
        t0 = time.perf_counter()
        run.save()
        dist.barrier()
        times["distlab_save"].append(time.perf_counter() - t0)
        path = Path(run.last_snapshot)
        dist.barrier()
        t0 = time.perf_counter()
        meta = snapshot.read_meta(path)
        payload = snapshot_load.load_rank_file(path, meta, rank)
        dist.barrier()
        times["distlab_load"].append(time.perf_counter() - t0)
        state = _dcp_state(trainer, rank, sharded)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(theirs)))
        dist.barrier()
        times["dcp_save"].append(time.perf_counter() - t0)
        target = _dcp_state(trainer, rank, sharded)  # fresh tensors of the right shapes, loaded in place
        for t in _tensors(target):
            t.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(theirs)))
        dist.barrier()
        times["dcp_load"].append(time.perf_counter() - t0)
        same = all(torch.equal(a, b) for a, b in zip(_tensors(target), _tensors(state)))
        same = same and all(torch.equal(a, b) for a, b in zip(_tensors(payload["model"]), _tensors(state)))
        if rank == 0:
            sizes = {"distlab": _size(path), "dcp": _size(theirs)}
        if not same:
            raise AssertionError(f"rank {rank}: what was loaded differs from what was saved (run {i})")
        dist.barrier()
        if rank == 0 and i < runs - 1:
            shutil.rmtree(ours, ignore_errors=True)
            shutil.rmtree(theirs, ignore_errors=True)
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(_dcp_state(trainer, rank, sharded)))
    return {"times": times, "sizes": sizes, "state_bytes": state_bytes}


def run(workloads=tuple(WORKLOADS), nproc: int = 2, runs: int = 3, dataset: str = "fashion-mnist",
        directory: str | None = None, out: str | None = "runs/bench-snapshot-format", progress=print) -> list[dict]:
    """One record per (workload, format)."""
    from distlab.launch.spawn import run_ranks
    chosen = choose("--workloads", workloads, tuple(WORKLOADS))
    at_least(nproc=(nproc, 1), runs=(runs, 1))
    records = []
    for workload in chosen:
        cfg = _config(workload, dataset, nproc)
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        root = tempfile.mkdtemp(prefix="distlab-snapfmt-", dir=directory)
        try:
            progress(f"snapshot-format: {workload} on {nproc} processes, {runs} runs ...")
            results = run_ranks(_measure, nproc, cfg, root, runs, WORKLOADS[workload][0] == "zero=3",
                                timeout=1800, threads=1)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        per_rank_state = [r["state_bytes"] for r in results]
        for fmt in ("distlab", "dcp"):
            # a rank's time is the collective's: every rank waits for the slowest (barriers around each)
            saves = [max(r["times"][f"{fmt}_save"][i] for r in results) for i in range(runs)]
            loads = [max(r["times"][f"{fmt}_load"][i] for r in results) for i in range(runs)]
            size, files = results[0]["sizes"][fmt]
            records.append({
                "workload": workload, "format": fmt, "strategy": WORKLOADS[workload][0],
                "optimizer": WORKLOADS[workload][2], "mlp_widths": list(WORKLOADS[workload][1]),
                "state_bytes_per_rank": per_rank_state, "runs": runs,
                "save_s_median": statistics.median(saves), "save_s_min": min(saves), "save_s_max": max(saves),
                "load_s_median": statistics.median(loads), "load_s_min": min(loads), "load_s_max": max(loads),
                "bytes_on_disk": size, "files": files,
                "checksums": fmt == "distlab", "atomic_commit": fmt == "distlab",
                "unpickles_with": "torch.load(weights_only=True)" if fmt == "distlab" else
                "pickle.load (.metadata) and torch.load(weights_only=False) (non-tensor entries)",
                **machine(nproc, 1)})
    write(records, out, "snapshot-format")
    return records


def table(records: list[dict], markdown: bool = False) -> str:
    rows = []
    base = {(r["workload"]): r for r in records if r["format"] == "distlab"}
    for r in records:
        b = base.get(r["workload"])
        ratio = f"{r['save_s_median'] / b['save_s_median']:.2f}x / {r['load_s_median'] / b['load_s_median']:.2f}x" \
            if b and r is not b else "1 / 1"
        rows.append([r["workload"], r["format"], f"{sum(r['state_bytes_per_rank']) / 2**20:.1f}",
                     f"{r['bytes_on_disk'] / 2**20:.1f} ({r['files']})",
                     f"{1000 * r['save_s_median']:.0f} [{1000 * r['save_s_min']:.0f}-{1000 * r['save_s_max']:.0f}]",
                     f"{1000 * r['load_s_median']:.0f} [{1000 * r['load_s_min']:.0f}-{1000 * r['load_s_max']:.0f}]",
                     ratio])
    return format_table(["workload", "format", "state MiB (all ranks)", "on disk MiB (files)", "save ms [range]",
                         "load ms [range]", "save / load vs distlab"], rows, markdown)
