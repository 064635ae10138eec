"""``distlab bench snapshot``: how long a snapshot holds the training up, written synchronously or in the
background (``--snapshot-async``).

The same run -- an MLP whose state (parameters and Adam's two moments) is ``--state-mb`` or more per
rank, snapshots every ``--every`` steps -- trained with each mode in interleaved rounds (sync, async,
sync, ...), each in a fresh process group. A snapshot's *stall* is the time ``RunState.save`` keeps the
training loop from its next step: the whole write when synchronous, the copy to host memory (and any
wait for the previous write still in flight) when asynchronous. Also recorded: the median training step
(a background write shares the machine's cores and disk with it) and the run's wall time.
"""

from __future__ import annotations

import math
import statistics
import tempfile

from distlab.bench.common import format_table, machine, write
from distlab.train.config import TrainConfig

MODES = ("sync", "async")
INPUT = 784  # a 1x28x28 image


def widths_for(state_mb: float) -> tuple[int, int]:
    """Two hidden layers of width W with ``3 x 4 x (784 W + W^2 + 10 W)`` bytes >= ``state_mb`` MB (fp32
    parameters and Adam's two moments)."""
    target = state_mb * 1e6 / 12
    w = math.ceil((-(INPUT + 10) + math.sqrt((INPUT + 10) ** 2 + 4 * target)) / 2)
    return (w, w)


def config(mode: str, state_mb: float, steps: int, every: int, directory: str) -> TrainConfig:
    return TrainConfig.from_flags(model="mlp", mlp_widths=widths_for(state_mb), dataset="synthetic:1x28x28:10:2048",
                                  global_batch_size=32, optimizer="adam", lr=1e-4, lr_schedule="constant",
                                  max_steps=steps, epochs=1000, snapshot_dir=directory, snapshot_every=every,
                                  keep_snapshots=2, snapshot_async=mode == "async", log_every=steps, progress=False,
                                  verbose=False, eval_every_epoch=False, eval_batches=1, timing_warmup_steps=2)


def run(nproc: int = 2, state_mb: float = 100.0, steps: int = 24, every: int = 4, runs: int = 3,
        out: str | None = "runs/bench", progress=print) -> list[dict]:
    from distlab.bench.common import train_on_ranks
    from distlab.launch.spawn import run_ranks
    records, facts = [], machine(nproc, 1)  # run_ranks: one thread per rank
    for r in range(runs):
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="distlab-bench-snapshot-") as d:
                cfg = config(mode, state_mb, steps, every, d)
                progress(f"snapshot: {mode}, round {r + 1} of {runs}, {nproc} processes ...")
                summary = run_ranks(train_on_ranks, nproc, cfg, timeout=1800)[0]
            records.append({"mode": mode, "round": r, "nproc": nproc, "steps": steps, "every": every,
                            "state_bytes_per_rank": summary["model_state_bytes_per_rank"],
                            "snapshot_stall_s_median": summary["snapshot_stall_s_median"],
                            "time_per_step_s_median": summary["time_per_step_s_median"],
                            "wall_time_s": summary["wall_time_s"], **facts})
    write(records, out, "snapshot")
    return records


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for mode in MODES:
        mine = [r for r in records if r["mode"] == mode]
        if mine:
            stalls = [r["snapshot_stall_s_median"] for r in mine]
            rows.append({"mode": mode, "state_mb": mine[0]["state_bytes_per_rank"] / 1e6,
                         "stall_s": statistics.median(stalls), "stall_min": min(stalls), "stall_max": max(stalls),
                         "step_s": statistics.median(r["time_per_step_s_median"] for r in mine),
                         "wall_s": statistics.median(r["wall_time_s"] for r in mine), "rounds": len(mine)})
    return rows


def table(records: list[dict], markdown: bool = False) -> str:
    rows = summarize(records)
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    cells = [[r["mode"], f"{r['state_mb']:.0f}", f"{1e3 * r['stall_s']:.1f}",
              f"{1e3 * r['stall_min']:.1f}-{1e3 * r['stall_max']:.1f}",
              f"{r['stall_s'] / sync['stall_s']:.3f}x" if sync else "-", f"{1e3 * r['step_s']:.1f}",
              f"{r['wall_s']:.1f}", str(r["rounds"])] for r in rows]
    return format_table(["mode", "state MB / rank", "stall ms / snapshot (median)", "range", "vs sync",
                         "step ms (median)", "wall s", "rounds"], cells, markdown)


def plot(records: list[dict], directory: str) -> list:
    return []
