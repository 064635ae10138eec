"""What every benchmark suite shares: the machine facts stamped on each record (``machine``), and writing JSON."""

from __future__ import annotations

import json
from pathlib import Path


from distlab.errors import ConfigError
from distlab.runtime import cores
from distlab.runtime.device import busy_machine, load_before_run, machine_facts
from distlab.train.metrics import atomic_write_text


def machine(ranks: int, threads_per_rank: int) -> dict:
    """Where and how a record was measured (so a table can say it): with the machine's load before it."""
    return {"ranks": ranks, "threads_per_rank": threads_per_rank,
            "oversubscribed": ranks * threads_per_rank > cores(), "load_before_run": load_before_run(),
            **machine_facts()}


def busy_bench(records: list[dict]) -> str | None:
    """Why a bench's timings mean less, if they do (:func:`~distlab.runtime.device.busy_machine`): the load the
    busiest of its records found before it ran (the load now for records that kept none), every core its."""
    loads = [r.get("load_before_run") for r in records if isinstance(r, dict)]
    load = max((v for v in loads if v is not None), default=None) if any(v is not None for v in loads) else \
        load_before_run()
    busy = busy_machine(load, cores(), cores())
    return (f"{busy.split(', so ')[0].replace('before this run', 'before this bench')}, so its timings -- and "
            f"which algorithm ranks first -- hold only against runs on an equally quiet machine") if busy else None


def choose(flag: str, names, allowed) -> list[str]:
    """``names`` (a list, or comma-separated text) checked against ``allowed``; at least one."""
    chosen = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    for n in chosen:
        if n not in allowed:
            raise ConfigError(f"unknown {flag} value {n!r}; choose from {', '.join(allowed)}")
    if not chosen:
        raise ConfigError(f"{flag}: give at least one of {', '.join(allowed)}")
    return chosen


def at_least(**minimums: tuple[int, int]) -> None:
    """``name=(value, minimum)``: raise naming every flag below its minimum."""
    low = [f"--{k.replace('_', '-')} {v} (at least {m})" for k, (v, m) in minimums.items() if v is None or v < m]
    if low:
        raise ConfigError("too small: " + ", ".join(low))


def format_table(headers: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    """Rows of display cells as aligned text (first column left, the rest right) or as Markdown."""
    if markdown:  # a "|" inside a cell (|loss - torch's|) is escaped: it would end the cell
        def line(cells):
            return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
        return "\n".join([line(headers), "|" + "---|" * len(headers)] + [line(row) for row in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    return "\n".join(" ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in
                              enumerate(zip(row, widths))).rstrip() for row in [headers, *rows])


def write(records: list[dict], out: str | Path | None, suite: str) -> Path | None:
    if not out:
        return None
    path = Path(out) / f"{suite}.json"
    atomic_write_text(path, json.dumps(records, indent=1) + "\n")
    return path


def text_for(init_from: str, dataset: str) -> dict:
    """What a benchmark's run from checkpoint ``init_from`` (hf:DIR) reads: ``dataset`` in bytes where the
    checkpoint's vocabulary is bytes' 256, else the fortunes read by a 512-token BPE learned from them (ids the
    model has; a benchmark measures memory and time, not what the ids mean)."""
    from distlab.models import hf
    if hf.config_of(init_from[3:]).get("vocab_size") == 256:
        return {"dataset": dataset, "tokenizer": "bytes"}
    return {"dataset": "fortunes", "tokenizer": "bpe:512"}


def train_on_ranks(rank: int, world: int, cfg) -> dict | None:
    """One training run on ranks started by :func:`distlab.launch.spawn.run_ranks`: rank 0's summary."""
    from distlab import runtime
    from distlab.train import Trainer
    summary = Trainer(cfg.validate(world), runtime.from_process_group()).fit()
    return summary if rank == 0 else None


def check_train(world_size: int, **fields) -> None:
    """Before a bench starts ``distlab train`` runs: the checks the run itself makes before launching
    (every field, the batch split, the data on disk), so a bad setting fails the bench in one line
    before its first run rather than in the middle of the grid."""
    from distlab.data import locate
    from distlab.train import TrainConfig
    cfg = TrainConfig.from_flags(**{k: v for k, v in fields.items() if v is not None}).validate(world_size)
    if not cfg.dataset.startswith("synthetic"):
        locate(cfg.dataset, cfg.data_dir)


def fresh_run_dir(path: str | Path) -> Path:
    """A bench's own run directory for one of its runs, emptied of what an earlier run of the bench
    left there (the bench rewrites its results, as it rewrites its JSON)."""
    import shutil
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    return path


