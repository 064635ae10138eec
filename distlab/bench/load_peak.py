"""``distlab bench load``: the memory each rank takes to load a model, before its first step.

Each layout (``--layouts``, strategies as ``distlab verify`` writes them) trains ``--init-from`` (a Hugging Face
checkpoint) on ``--nproc`` ranks -- its values read from the checkpoint, or (``random``) a new model of its
shape initialised from the seed -- made two ways in fresh process groups: *deferred* -- what ``distlab train``
does: the model built on the meta device, each rank giving values only to what its layout holds
(:mod:`distlab.models.deferred`, :func:`distlab.parallel.placement.state_from_stream`) -- and *whole*: the
model built and initialised whole on every rank first, then cut (how it was made before). Per rank: the
resident set's peak while the trainer is made, above what the process held before (``VmHWM``, reset
first, minus the resident set before), beside what it should be: the model state the rank holds as placed plus the largest tensor
(float32), the one transient a piecewise load needs.
"""

from __future__ import annotations

import math
import resource
import statistics

from distlab.bench.common import format_table, machine, write

MODES = ("deferred", "whole")
SOURCES = ("checkpoint", "random")


def rss() -> int:
    """This process's resident set now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak() -> None:
    """Start the resident set's peak (``VmHWM``) afresh from now: a forked rank's peak would otherwise start
    from its parent's (Linux 4.0+: ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    """The resident set's peak since :func:`reset_peak`, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _load(rank: int, world: int, cfg, mode: str, source: str) -> dict:
    import dataclasses

    import torch

    from distlab import runtime
    from distlab.parallel.placement import placement_of
    from distlab.train import Trainer
    import distlab.models.deferred as deferred_module
    if mode == "whole":  # the model built whole on every rank, then cut (no meta build)
        deferred_module.deferred = lambda make: (make(), None)
    cfg = cfg.validate(world)
    if source == "random":  # the checkpoint's shape, initialised as a new model (no file read)
        cfg = dataclasses.replace(cfg, init_from=None, vocab_size=cfg.vocab(0))
    import time

    import torch._dynamo  # noqa: F401 - torch imports it under the meta build's dispatch mode: code, not the model
    reset_peak()
    before, began = rss(), time.perf_counter()
    trainer = Trainer(cfg, runtime.from_process_group())
    top, seconds = peak(), time.perf_counter() - began  # the model made and placed: the first step comes next
    held = trainer.engine.observe()
    shapes = [p["shape"] for p in placement_of(trainer.engine)["params"]]
    largest = max(torch.Size(s).numel() for s in shapes) * 4
    return {"rank": rank, "rss_before_bytes": before, "rss_peak_bytes": top, "load_peak_bytes": top - before,
            "model_state_bytes": held, "largest_tensor_bytes": largest,
            "whole_model_bytes": 4 * trainer.num_parameters, "load_s": seconds}


def config(init_from: str, strategy: str):
    from distlab.parallel import Strategy
    from distlab.train.config import TrainConfig
    from distlab.bench.common import text_for
    return TrainConfig.from_flags(init_from=init_from, **text_for(init_from, "synthetic-text:4000"), block_size=16,
                                  global_batch_size=4, max_steps=1, optimizer="sgd", lr=1e-3, progress=False,
                                  verbose=False, eval_every_epoch=False, eval_batches=1, eval_batch_size=4,
                                  strategy=Strategy.parse(strategy))


def run(init_from: str, nproc: int = 4, layouts=("zero=3", "tp=2"), modes=MODES, sources=SOURCES, runs: int = 1,
        out: str | None = "runs/bench", progress=print) -> list[dict]:
    from distlab.launch.spawn import run_ranks
    from distlab.errors import ConfigError
    records, facts = [], machine(nproc, 1)
    for layout in layouts:  # every layout checked here, before any rank starts
        try:
            config(init_from, layout).validate(nproc)
        except ValueError as exc:
            raise ConfigError(f"--layouts {layout!r}: {exc}") from None
    for r in range(runs):
        for layout in layouts:
            for source in sources:
                for mode in modes:
                    progress(f"load: {layout}, {source}, {mode}, round {r + 1} of {runs}, {nproc} processes ...")
                    for rec in run_ranks(_load, nproc, config(init_from, layout), mode, source, timeout=3600):
                        records.append({"layout": layout, "source": source, "mode": mode, "round": r,
                                        "nproc": nproc, "init_from": init_from, **rec, **facts})
    write(records, out, "load")
    return records


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for layout, source, mode in dict.fromkeys((r["layout"], r["source"], r["mode"]) for r in records):
        mine = [r for r in records if (r["layout"], r["source"], r["mode"]) == (layout, source, mode)]
        if mine:
            expected = [r["model_state_bytes"] + r["largest_tensor_bytes"] for r in mine]
            rows.append({"layout": layout, "source": source, "mode": mode, "ranks": mine[0]["nproc"],
                         "peak": statistics.median(r["load_peak_bytes"] for r in mine),
                         "peak_max": max(r["load_peak_bytes"] for r in mine),
                         "state": statistics.median(r["model_state_bytes"] for r in mine),
                         "largest": mine[0]["largest_tensor_bytes"], "expected": statistics.median(expected),
                         "whole": mine[0]["whole_model_bytes"],
                         "seconds": statistics.median(r.get("load_s", math.nan) for r in mine)})
    return rows


def table(records: list[dict], markdown: bool = False) -> str:
    gb = 1e9
    cells = [[r["layout"], r["source"], r["mode"], str(r["ranks"]), f"{r['peak'] / gb:.2f}", f"{r['peak_max'] / gb:.2f}",
              f"{r['state'] / gb:.2f}", f"{r['largest'] / gb:.2f}", f"{r['expected'] / gb:.2f}",
              f"{r['peak'] / r['expected']:.2f}x", f"{r['whole'] / gb:.2f}", f"{r['seconds']:.1f}"]
             for r in summarize(records)]
    return format_table(["layout", "values from", "model built", "ranks", "load peak GB (median rank)", "max rank",
                         "state held GB", "largest tensor GB", "state + largest GB", "peak / (state + largest)",
                         "whole model GB", "to the first step s (median rank)"], cells, markdown)


def plot(records: list[dict], directory: str) -> list[str]:
    return []


__all__ = ["MODES", "SOURCES", "config", "plot", "run", "summarize", "table"]
