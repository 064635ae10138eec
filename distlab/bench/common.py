"""What every benchmark suite shares: the machine facts stamped on each record, and writing JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

from distlab.train.metrics import atomic_write_text


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine(ranks: int, threads_per_rank: int) -> dict:
    """Where and how a record was measured (so a table can say it)."""
    return {"ranks": ranks, "threads_per_rank": threads_per_rank, "cores": cores(),
            "oversubscribed": ranks * threads_per_rank > cores(), "torch_version": torch.__version__,
            "host": platform.node(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write(records: list[dict], out: str | Path | None, suite: str) -> Path | None:
    if not out:
        return None
    path = Path(out) / f"{suite}.json"
    atomic_write_text(path, json.dumps(records, indent=1) + "\n")
    return path
