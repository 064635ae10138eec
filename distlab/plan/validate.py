"""``distlab plan validate``: predictions against measured runs, per run and in summary."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from distlab.errors import ConfigError
from distlab.plan.calibration import Calibration, json_files, load_json, plannable, run_summary, trace_for
from distlab.plan.machine import TBF_BURST, Link
from distlab.parallel import Strategy
from distlab.parallel.cost import Call
from distlab.plan.predict import Layout, predict
from distlab.plan.timing import SyncTimer


def _measured_runs(paths: list[str]) -> list[tuple[dict, Link, str]]:
    """(summary, link, label) of every multi- or one-worker run found: bench scaling records
    (with the emulated link they ran over) and run directories (the emulated link their summary records
    when ``distlab cluster run`` started them, else loopback)."""
    runs, seen = [], set()
    # bench JSON first: a run directory it names is then known with the link it ran over
    for path in sorted(json_files(paths), key=lambda p: p.name == "summary.json"):
        data = load_json(path)
        if isinstance(data, list) and data and isinstance(data[0], dict) and "run_dir" in data[0]:
            for r in data:
                for run_dir in r.get("run_dirs") or [r["run_dir"]]:  # bench compression: one per round
                    s = run_summary(path, run_dir)
                    if s is None or str(s.resolve()) in seen:
                        continue
                    seen.add(str(s.resolve()))
                    bw = r.get("bandwidth")
                    link = Link.parse(bw, r.get("delay"), r.get("burst", TBF_BURST)) if bw else Link()
                    runs.append((load_json(s), link, f"{Path(run_dir).name}"))
        elif isinstance(data, dict) and "world_size" in data and "model" in data and str(path.resolve()) not in seen:
            seen.add(str(path.resolve()))
            where = data.get("cluster") or {}  # a run on the emulated cluster records its link
            bw = where.get("link") if where.get("link") not in (None, "unshaped") else None
            link = Link.parse(bw, where.get("delay"), where.get("burst") or TBF_BURST) if bw else Link()
            runs.append((data, link, path.parent.name))
    return runs


def layout_of(summary: dict, threads: int | None = None) -> Layout:
    st, cfg = summary.get("strategy", {}), summary.get("config", {})
    strategy = Strategy.from_dict(st)
    threads = threads or summary.get("threads_per_rank") or 1
    over = summary["world_size"] * threads / summary["cores"] if summary.get("cores") else 1.0
    return Layout(dp=strategy.dp_size(summary["world_size"]), strategy=strategy, optimizer=summary.get("optimizer", "sgd"),
                  momentum=cfg.get("momentum", 0.9), optimizer_state=cfg.get("optimizer_state", "fp32"),
                  offload=cfg.get("offload", "none"), global_batch=summary["global_batch_size"],
                  threads=threads, oversubscription=max(1.0, over),
                  pairs=str(summary.get("dataset", "")).startswith(("dpo:", "synthetic-pairs")),
                  group=cfg.get("group_size", 4) if str(summary.get("dataset", "")).startswith(("rl:", "synthetic-rl"))
                  else 1)


def validate(cal: Calibration, paths: list[str], world_min: int = 2) -> list[dict]:
    """Predicted vs measured step time and memory for every training run under ``paths`` with at
    least ``world_min`` workers (rows of kind ``training``), then every collective measured across
    nodes (kind ``collective``)."""
    traces: dict = {}
    rows = []
    for s, link, label in _measured_runs(paths):
        if s["world_size"] < world_min or not s.get("time_per_step_s_median") or not plannable(s):
            continue
        lay = layout_of(s)
        p = predict(trace_for(s, traces), lay, link, cal)
        measured = s["time_per_step_s_median"]
        mem = s.get("model_state_bytes_per_rank")
        rows.append({"kind": "training", "run": label, "model": s["model"], "world_size": s["world_size"], "link": link.name,
                     "dp_sync": lay.dp_sync, "zero": lay.zero, "tp": lay.tp, "pp": lay.pp, "local_batch_size": s["local_batch_size"],
                     "measured_step_s": measured, "predicted_step_s": p["step_s"],
                     "time_rel_err": (p["step_s"] - measured) / measured,
                     "predicted_compute_s": p["compute_s"], "predicted_exposed_comm_s": p["exposed_comm_s"],
                     "measured_model_state_bytes": mem, "predicted_model_state_bytes": p["model_state_bytes_per_rank"],
                     "memory_exact": p["model_state_exact"],
                     "memory_rel_err": (p["model_state_bytes_per_rank"] - mem) / mem if mem else None,
                     "measured_comm_bytes": s.get("comm_bytes_per_step"),
                     "predicted_comm_bytes": p["comm_bytes_per_step_per_rank"],
                     **_phases(s, p)})
    rows += validate_collectives(cal, paths)
    if not rows:
        raise ConfigError(f"no runs with {world_min}+ workers under {', '.join(paths)} (run directories with "
                          f"summary.json, bench scaling JSON, or bench collectives JSON measured across nodes)")
    return rows


def _phases(summary: dict, p: dict) -> dict:
    """A traced run (``--trace``) compared phase by phase: compute per step (mean over ranks), exposed
    communication per step (the most of any rank) and, for a pipeline, the stages' waits over their
    schedule (the bubble, mean over stages) against the prediction's; {} for a run without a trace."""
    trace = summary.get("trace") or {}
    ranks = trace.get("per_rank") or []
    if not ranks:
        return {}
    out = {"measured_compute_s": statistics.mean(r["compute_s_per_step"] for r in ranks),
           "measured_exposed_comm_s": trace.get("exposed_communication_s_per_step")}
    if trace.get("pipeline_wait_fraction") is not None:
        out.update(measured_bubble=trace["pipeline_wait_fraction"], predicted_bubble=p["pipeline"]["bubble_ideal"])
    return out


def summarize(rows: list[dict]) -> dict:
    errs = [abs(r["time_rel_err"]) for r in rows]
    mem = [abs(r["memory_rel_err"]) for r in rows if r["memory_rel_err"] is not None and r["memory_exact"]]
    sent = [r["measured_comm_bytes"] == r["predicted_comm_bytes"] for r in rows if r.get("measured_comm_bytes") is not None]
    return {"runs": len(rows), "median_abs_time_err": statistics.median(errs), "max_abs_time_err": max(errs),
            "memory_exact_runs": sum(1 for m in mem if m == 0), "memory_checked_runs": len(mem),
            "max_abs_memory_err": max(mem) if mem else None,
            "bytes_exact_runs": sum(sent), "bytes_checked_runs": len(sent)}


def validate_collectives(cal: Calibration, paths: list[str]) -> list[dict]:
    """Predicted vs measured time of every collective measured across nodes (``bench collectives``
    launched on a cluster, records with a ``link``): the communication model alone."""
    rows = []
    for path in json_files(paths):
        data = load_json(path)
        if not (isinstance(data, list) and data and isinstance(data[0], dict) and "algorithm" in data[0]):
            continue
        for r in data:
            if r.get("link") in (None, "loopback") or r.get("op", "sum") not in ("sum", "avg") or not r["numel"]:
                continue
            link = Link.parse(r["link"], r.get("latency"), r.get("burst"))
            n = r["world_size"]
            nbytes = r["numel"] * torch.empty(0, dtype=getattr(torch, r.get("dtype", "float32"))).element_size()
            timer = SyncTimer(cal, link, n, same_host=bool(r.get("oversubscribed")))
            timer.link_free = 0.0  # the bench runs the algorithms back to back: the link never idles long
            predicted = timer.duration(Call(r["algorithm"], "all_reduce", nbytes), 0.0)
            measured = r["time_s_median"]
            rows.append({"kind": "collective", "run": f"{r['algorithm']} {r['numel']:.0e} el.", "model": "-",
                         "world_size": n, "link": link.name, "dp_sync": r["algorithm"], "zero": None, "tp": None,
                         "local_batch_size": None, "measured_step_s": measured, "predicted_step_s": predicted,
                         "time_rel_err": (predicted - measured) / measured, "predicted_compute_s": 0.0,
                         "predicted_exposed_comm_s": predicted, "measured_model_state_bytes": None,
                         "predicted_model_state_bytes": None, "memory_exact": False, "memory_rel_err": None})
    return rows


def summaries(rows: list[dict]) -> dict[str, dict]:
    """:func:`summarize` per kind of row (``training``, ``collective``), in that order."""
    return {kind: summarize([r for r in rows if r["kind"] == kind]) for kind in ("training", "collective")
            if any(r["kind"] == kind for r in rows)}
