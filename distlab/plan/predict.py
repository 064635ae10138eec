"""``distlab plan``: predict a layout's step time and memory, calibrate, validate, sweep.

:class:`Calibration` holds what was fitted on this machine (collectives' alpha-beta per
algorithm, the compute rate per threads-per-rank) and where it came from; :func:`predict` turns a
model trace, a :class:`Layout` and a :class:`~distlab.plan.cost.Link` into time and memory per
rank; :func:`validate` compares predictions with measured runs; :func:`sweep` walks world sizes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from distlab.cluster import TBF_BURST
from distlab.data import dataset_shape
from distlab.errors import ConfigError
from distlab.parallel.zero import goes_alone
from distlab.plan.cost import (ALGORITHMS, DDP_FIRST_BUCKET, AlphaBeta, Compute, Link, fit_alpha_beta, fit_compute,
                               rounds, volume)
from distlab.plan.memory import Optim, Trace, data_parallel_bytes, trace, zero_peak_bytes
from distlab.train.metrics import atomic_write_text

DP_SYNCS = ("ddp", "bucketed", "allreduce", "gather-scatter")


@dataclass(frozen=True)
class Layout:
    """What to predict for: world layout, strategy and batch."""
    dp: int = 1
    tp: int = 1
    zero: int = 0
    dp_sync: str = "ddp"
    collective: str = "native"
    bucket_mb: float = 25.0
    grad_accum: int = 1
    optimizer: str = "sgd"
    momentum: float = 0.9
    global_batch: int = 64
    threads: int | None = None
    oversubscription: float = 1.0  # ranks x threads per core on the busiest host: compute runs this much slower

    def check(self) -> "Layout":
        if self.dp < 1 or self.tp < 1:
            raise ConfigError(f"--dp {self.dp} --tp {self.tp}: both must be at least 1")
        if self.global_batch % (self.dp * self.grad_accum):
            raise ConfigError(f"global batch {self.global_batch} does not split over {self.dp} data-parallel "
                              f"ranks x {self.grad_accum} micro-batches: choose a multiple of "
                              f"{self.dp * self.grad_accum}")
        if self.dp_sync not in DP_SYNCS:
            raise ConfigError(f"unknown --dp-sync {self.dp_sync!r}; choose one of: {', '.join(DP_SYNCS)}")
        if self.collective not in ALGORITHMS:
            raise ConfigError(f"unknown --collective {self.collective!r}; choose one of: {', '.join(ALGORITHMS)}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {self.zero}: choose 0, 1, 2 or 3")
        return self

    @property
    def world(self) -> int:
        return self.dp * self.tp


# ---------------------------------------------------------------------------------- calibration

@dataclass
class Calibration:
    collectives: dict[str, AlphaBeta]            # per algorithm, from runs that had a core per rank
    compute: dict[int, Compute]
    machine: dict
    sources: list[str]
    by_world: dict[tuple[str, int], AlphaBeta] = field(default_factory=dict)  # per (algorithm, world), all runs

    def to_dict(self) -> dict:
        worlds: dict[str, dict] = {}
        for (a, n), ab in sorted(self.by_world.items()):
            worlds.setdefault(a, {})[str(n)] = ab.to_dict()
        return {"kind": "distlab-plan-calibration", "machine": self.machine, "sources": self.sources,
                "collectives": {a: ab.to_dict() for a, ab in self.collectives.items()},
                "collectives_by_world": worlds, "compute": [c.to_dict() for c in self.compute.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        if d.get("kind") != "distlab-plan-calibration":
            raise ConfigError("not a distlab plan calibration file (make one with `distlab plan calibrate`)")
        def ab(v: dict) -> AlphaBeta:
            return AlphaBeta(v["alpha_s"], v["beta_s_per_byte"], v.get("points", 0), v.get("median_rel_err"),
                             v.get("max_rel_err"))

        colls = {a: ab(v) for a, v in d["collectives"].items()}
        worlds = {(a, int(n)): ab(v) for a, per in d.get("collectives_by_world", {}).items() for n, v in per.items()}
        comp = {int(c["threads_per_rank"]): Compute(c["flops_per_s"], c["overhead_s"], int(c["threads_per_rank"]),
                                                    c.get("points", 0), c.get("median_rel_err"), c.get("max_rel_err"))
                for c in d["compute"]}
        return cls(colls, comp, d.get("machine", {}), d.get("sources", []), worlds)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise ConfigError(f"calibration {path} not found: make it with `distlab plan calibrate BENCH_DIRS -o "
                              f"{path}`") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"calibration {path} is not a valid calibration file ({exc}); make it again with "
                              f"`distlab plan calibrate`") from None

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def alpha_beta(self, algorithm: str, world: int | None = None) -> AlphaBeta:
        """The fit for ``algorithm``; with ``world``, the one measured at that world size if any (for
        runs that share this machine's cores the way the bench's ranks did)."""
        if world is not None and (algorithm, world) in self.by_world:
            return self.by_world[algorithm, world]
        if algorithm in self.collectives:
            return self.collectives[algorithm]
        if "native" in self.collectives:
            return self.collectives["native"]
        raise ConfigError(f"the calibration has no {algorithm!r} collective measurements: calibrate with "
                          f"`distlab bench collectives --algorithms {algorithm}` results")

    def compute_for(self, threads: int | None) -> Compute:
        if not self.compute:
            raise ConfigError("the calibration has no compute rate: give `distlab plan calibrate` a one-worker "
                              "training run (a run directory with summary.json, world size 1)")
        if threads in self.compute:
            return self.compute[threads]
        if threads is None:
            return max(self.compute.values(), key=lambda c: (c.points, c.threads))
        near = min(self.compute, key=lambda k: abs(k - threads))  # FLOP rate scales with threads, roughly
        c = self.compute[near]
        return replace(c, rate=c.rate * threads / near, threads=threads)


def _json_files(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.json") if q.name in ("collectives.json", "summary.json",
                                                                        "scaling.json"))
        elif p.exists():
            found.append(p)
        else:
            raise ConfigError(f"{p} not found")
    return found


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc})") from None


def _run_summary(bench_json: Path, run_dir: str) -> Path | None:
    """A bench record's run directory: the one under the bench file's own ``runs/`` (where bench
    writes it; found after the whole directory is moved or copied), else where it was written."""
    for d in (bench_json.parent / "runs" / Path(run_dir).name, Path(run_dir)):
        if (d / "summary.json").exists():
            return d / "summary.json"
    return None


def _summary_flops(summary: dict, traces: dict) -> float:
    t = _trace_for(summary, traces)
    return t.flops_per_sample * summary["local_batch_size"] / max(1, summary.get("strategy", {}).get("tp") or 1)


def _trace_for(summary: dict, traces: dict) -> Trace:
    shape, k = (tuple(summary["input_shape"]), summary["num_classes"]) if "input_shape" in summary else \
        dataset_shape(summary["dataset"])
    widths = tuple(summary.get("config", {}).get("mlp_widths") or (512, 256))
    key = (summary["model"], shape, k, widths)
    if key not in traces:
        traces[key] = trace(summary["model"], shape, k, widths=widths)
    return traces[key]


def calibrate(paths: list[str]) -> Calibration:
    """Fit collectives' alpha-beta (``distlab bench collectives`` JSON) and the compute rate (run
    directories / ``bench scaling`` JSON of one-worker runs) found under ``paths``."""
    coll: dict[str, list] = {}
    per_world: dict[tuple[str, int], list] = {}
    comp: dict[int, list] = {}
    sources: list[str] = []
    traces: dict = {}
    seen_runs: set[str] = set()
    for path in _json_files(paths):
        data = _load(path)
        if isinstance(data, list) and data and isinstance(data[0], dict) and "algorithm" in data[0]:
            sources.append(str(path))
            summed = [r for r in data if r.get("op", "sum") in ("sum", "avg")]
            alone = [r for r in summed if not r.get("oversubscribed")]
            for r in summed:
                nbytes = r["numel"] * torch.empty(0, dtype=getattr(torch, r.get("dtype", "float32"))).element_size()
                n = r["world_size"]
                if n > 1 and r["time_s_median"] > 0 and nbytes > 0:
                    point = (rounds(r["algorithm"], n), volume(r["algorithm"], n, nbytes), r["time_s_median"])
                    per_world.setdefault((r["algorithm"], n), []).append(point)
                    if r in alone or not alone:
                        coll.setdefault(r["algorithm"], []).append(point)
            continue
        summaries = []
        if isinstance(data, dict) and "world_size" in data and "model" in data:
            summaries.append((path, data))
        elif isinstance(data, list):  # bench scaling: its one-worker runs
            for r in data:
                if isinstance(r, dict) and r.get("world_size") == 1 and r.get("run_dir"):
                    s = _run_summary(path, r["run_dir"])
                    if s is not None:
                        summaries.append((s, _load(s)))
        for spath, s in summaries:
            if s.get("world_size") != 1 or not s.get("time_per_step_s_median") or str(spath.resolve()) in seen_runs:
                continue
            seen_runs.add(str(spath.resolve()))
            sources.append(str(spath))
            comp.setdefault(int(s.get("threads_per_rank") or 1), []).append(
                (_summary_flops(s, traces), s["time_per_step_s_median"]))
    if not coll and not comp:
        raise ConfigError(f"no bench collectives JSON or one-worker training runs under {', '.join(paths)}")
    machine = {"host": socket.gethostname(), "cores": os.cpu_count(), "torch_version": torch.__version__,
               "python_version": platform.python_version(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return Calibration({a: fit_alpha_beta(v) for a, v in coll.items()},
                       {k: fit_compute(v, k) for k, v in comp.items()}, machine, sources,
                       {k: fit_alpha_beta(v) for k, v in per_world.items()})


# ---------------------------------------------------------------------------------- prediction

@dataclass
class _Call:
    algorithm: str
    kind: str           # all_reduce | reduce_scatter | all_gather
    nbytes: float       # the whole tensor (all-reduce) / the full, gathered size (RS, AG)
    ready: float = 1.0  # fraction of backward done when it may start (1 = after backward)


def _buckets(sizes: list[int], cap: int, first_cap: int | None = None) -> list[tuple[int, int]]:
    """(bytes, bytes of gradients ready when it is full) of buckets over ``sizes`` in backward order."""
    out, cur, done, limit = [], 0, 0, first_cap or cap
    for s in sizes:
        cur += s
        done += s
        if cur >= limit:
            out.append((cur, done))
            cur, limit = 0, cap
    if cur:
        out.append((cur, done))
    return out


def _calls(t: Trace, lay: Layout) -> tuple[list[_Call], list[_Call], list[_Call]]:
    """(overlappable during backward, after backward, after the optimizer step) collectives of the
    data-parallel group, and for ZeRO-3 the exposed all-gathers are returned in 'after backward'
    with ready 0 ... see predict()."""
    n, e = lay.dp, t.element_size
    sizes = [m * e for m in t.numels]
    total = sum(sizes)
    if n == 1:
        return [], [], []
    alg = lay.collective
    if lay.zero:
        shard = [math.ceil(m / n) for m in t.numels]
        padded = [s * n * e for s in shard]
        modules: dict[int, list[int]] = {}
        for u, m in enumerate(t.module_of):
            modules.setdefault(m, []).append(u)

        def groups(units):  # ZeRO's collective batches (distlab.parallel.zero.Zero._groups)
            alone = [[u] for u in units if goes_alone(t.numels[u])]
            small = [u for u in units if not goes_alone(t.numels[u])]
            return alone + ([small] if small else [])

        per_module = [sum(padded[u] for u in g) for m in modules.values() for g in groups(m)]
        everything = [sum(padded[u] for u in g) for g in groups(list(range(len(sizes))))]
        if lay.zero == 1:
            return [], [_Call(alg, "reduce_scatter", b) for b in everything], \
                [_Call(alg, "all_gather", b) for b in everything]
        done, overl = 0, []
        for b in reversed(per_module):  # backward reaches the last layers first
            done += b
            overl.append(_Call(alg, "reduce_scatter", b, done / sum(per_module)))
        if lay.zero == 2:
            return overl, [], [_Call(alg, "all_gather", b) for b in everything]
        gathers = [_Call(alg, "all_gather", b, 0.0) for b in per_module] * 2  # before forward and before backward
        return overl, gathers, []
    if lay.dp_sync == "gather-scatter":
        return [], [_Call("gather_scatter", "all_reduce", total)], []
    if lay.dp_sync == "allreduce":
        return [], [_Call(alg, "all_reduce", s) for s in sizes], []
    cap = int(lay.bucket_mb * 2**20)
    buckets = _buckets(list(reversed(sizes)), cap, DDP_FIRST_BUCKET if lay.dp_sync == "ddp" else None)
    return [_Call(alg, "all_reduce", b, done / total) for b, done in buckets], [], []


def _tp_calls(t: Trace, lay: Layout, micro: int) -> list[_Call]:
    """Megatron MLP blocks: per (column, row) pair of Linears, one all-reduce of the block's output
    in forward and one of its input gradient in backward."""
    if lay.tp == 1:
        return []
    e, calls = t.element_size, []
    pairs = list(zip(t.linear_shapes[0::2], t.linear_shapes[1::2]))
    for (d_in, _), (_, d_out) in pairs:
        calls += [_Call("native", "all_reduce", micro * d_out * e), _Call("native", "all_reduce", micro * d_in * e)]
    return calls * lay.grad_accum


class _Timer:
    def __init__(self, cal: Calibration, link: Link, n: int, same_host: bool = False):
        self.cal, self.link, self.n = cal, link, n
        self.world = n if same_host else None  # use the fit measured at this world size (shared cores)
        self.link_free = 0.0  # when the link last went idle (for the token bucket)

    def duration(self, call: _Call, start: float) -> float:
        if self.n <= 1:
            return 0.0
        ab = self.cal.alpha_beta(call.algorithm, self.world)
        r, v = rounds(call.algorithm, self.n, call.kind), volume(call.algorithm, self.n, call.nbytes, call.kind)
        host = ab.alpha * r + ab.beta * v
        if self.link.bandwidth is None:
            return host
        rate = self.link.bandwidth * self.link.efficiency
        idle = max(0.0, start - self.link_free)
        if call.algorithm == "gather_scatter":  # rank 0's two phases: each direction idled during the other
            phase = v / 2
            wire = 2 * max(0.0, phase - min(self.link.burst, self.link.bandwidth * (phase / rate + idle))) / rate
        else:
            wire = max(0.0, v - min(self.link.burst, self.link.bandwidth * idle)) / rate
        return host + r * self.link.latency + wire


def predict(t: Trace, lay: Layout, link: Link, cal: Calibration | None) -> dict:
    """Memory per rank and (with a calibration) time per step of ``lay`` over ``link``."""
    lay.check()
    if lay.tp > 1 and len(t.linear_shapes) < 2:
        raise ConfigError(f"--tp {lay.tp}: distlab's tensor parallel shards pairs of Linear layers (MLPs); this model "
                          f"has {len(t.linear_shapes)} Linear layer(s): plan it with --tp 1")
    micro = lay.global_batch // lay.dp // lay.grad_accum
    optim = Optim.of(lay.optimizer, lay.momentum)
    if lay.tp == 1:
        state = zero_peak_bytes(t, lay.zero, lay.dp, optim, lay.grad_accum) if lay.zero else \
            data_parallel_bytes(t, optim)
        exact = True
    else:  # tensor parallel: every rank holds 1/tp of the (sharded) layers -- an estimate
        shrunk = replace(t, numels=[math.ceil(m / lay.tp) for m in t.numels])
        state = zero_peak_bytes(shrunk, lay.zero, lay.dp, optim, lay.grad_accum) if lay.zero else \
            data_parallel_bytes(shrunk, optim)
        exact = False
    e, n = t.element_size, lay.dp
    shards = [math.ceil(m / lay.tp / n) for m in t.numels]
    full = [math.ceil(m / lay.tp) for m in t.numels]
    parts = {  # the textbook split (ZeRO paper, table 1): what each kind comes to between steps
        "parameter_bytes_per_rank": e * sum(shards if lay.zero == 3 else full),
        "gradient_bytes_per_rank": e * sum(shards if lay.zero >= 2 else full),
        "optimizer_bytes_per_rank": sum(optim.bytes(m, e) for m in (shards if lay.zero >= 1 else full)),
    }
    out = {"layout": {"dp": lay.dp, "tp": lay.tp, "zero": lay.zero, "dp_sync": lay.dp_sync,
                      "collective": lay.collective, "global_batch_size": lay.global_batch,
                      "grad_accum": lay.grad_accum, "optimizer": lay.optimizer, "world_size": lay.world},
           "link": {"name": link.name, "bandwidth_Bps": link.bandwidth, "latency_s": link.latency,
                    "burst_bytes": link.burst},
           "num_parameters": t.num_parameters,
           "model_state_bytes_per_rank": int(state), "model_state_exact": exact,
           "model_state_basis": "peak of parameters + gradients + optimizer state, with ZeRO's transient buffers",
           **parts,
           "activation_bytes_per_rank": int(t.activation_bytes_per_sample * micro / lay.tp),
           "activation_basis": "tensors autograd saves for backward, one micro-batch (an upper bound)"}
    out["memory_bytes_per_rank"] = out["model_state_bytes_per_rank"] + out["activation_bytes_per_rank"]
    if cal is None:
        return out
    comp = cal.compute_for(lay.threads)
    if lay.oversubscription > 1:
        comp = replace(comp, rate=comp.rate / lay.oversubscription, overhead=comp.overhead * lay.oversubscription)
    flops = t.flops_per_sample * micro * lay.grad_accum / lay.tp
    fwd = t.forward_flops_per_sample * micro * lay.grad_accum / lay.tp / comp.rate
    bwd = flops / comp.rate - fwd
    overlapped, after, after_step = _calls(t, lay)
    timer = _Timer(cal, link, lay.dp, same_host=lay.oversubscription > 1)
    exposed_pre = 0.0
    if lay.zero == 3:  # all-gathers before each layer's forward and backward: the layer waits
        for c in after:
            exposed_pre += timer.duration(c, 0.0)
        after = []
    tp_timer = _Timer(cal, link if lay.dp == 1 else Link(), lay.tp)  # a TP group shares a node's fast links
    tp_time = sum(tp_timer.duration(c, 0.0) for c in _tp_calls(t, lay, micro))
    comm_total = exposed_pre + tp_time
    start_bwd = fwd + exposed_pre / 2
    end_bwd = start_bwd + bwd + exposed_pre / 2
    free = 0.0
    timer.link_free = -comp.overhead  # the optimizer step of the previous step left the link idle
    for c in sorted(overlapped, key=lambda c: c.ready):
        s = max(start_bwd + c.ready * bwd, free)
        d = timer.duration(c, s)
        free, timer.link_free, comm_total = s + d, s + d, comm_total + d
    cur = max(end_bwd, free)
    for c in after:
        d = timer.duration(c, cur)
        cur, timer.link_free, comm_total = cur + d, cur + d, comm_total + d
    cur += comp.overhead
    for c in after_step:
        d = timer.duration(c, cur)
        cur, timer.link_free, comm_total = cur + d, cur + d, comm_total + d
    step = cur + tp_time
    compute = comp.time(flops)
    out.update({"oversubscription": lay.oversubscription, "compute_s": compute, "comm_s": comm_total, "exposed_comm_s": step - compute, "step_s": step,
                "samples_per_s": lay.global_batch / step, "threads_per_rank": comp.threads,
                "scaling_efficiency": compute / step if step else None})
    return out


# ---------------------------------------------------------------------------------- validation

def _measured_runs(paths: list[str]) -> list[tuple[dict, Link, str]]:
    """(summary, link, label) of every multi- or one-worker run found: bench scaling records
    (with the emulated link they ran over) and run directories (loopback)."""
    runs, seen = [], set()
    # bench JSON first: a run directory it names is then known with the link it ran over
    for path in sorted(_json_files(paths), key=lambda p: p.name == "summary.json"):
        data = _load(path)
        if isinstance(data, list) and data and isinstance(data[0], dict) and "run_dir" in data[0]:
            for r in data:
                s = _run_summary(path, r["run_dir"])
                if s is None or str(s.resolve()) in seen:
                    continue
                seen.add(str(s.resolve()))
                bw = r.get("bandwidth")
                link = Link.parse(bw, r.get("delay"), r.get("burst", TBF_BURST)) if bw else Link()
                runs.append((_load(s), link, f"{Path(r['run_dir']).name}"))
        elif isinstance(data, dict) and "world_size" in data and "model" in data and str(path.resolve()) not in seen:
            seen.add(str(path.resolve()))
            runs.append((data, Link(), path.parent.name))
    return runs


def layout_of(summary: dict, threads: int | None = None) -> Layout:
    st, cfg = summary.get("strategy", {}), summary.get("config", {})
    tp = st.get("tp") or 1
    threads = threads or summary.get("threads_per_rank") or 1
    over = summary["world_size"] * threads / summary["cores"] if summary.get("cores") else 1.0
    return Layout(dp=summary["world_size"] // tp, tp=tp, zero=st.get("zero") or 0, dp_sync=st.get("dp_sync", "ddp"),
                  collective=st.get("collective", "native"), bucket_mb=st.get("bucket_mb", 25.0),
                  grad_accum=st.get("grad_accum", 1), optimizer=summary.get("optimizer", "sgd"),
                  momentum=cfg.get("momentum", 0.9), global_batch=summary["global_batch_size"],
                  threads=threads, oversubscription=max(1.0, over))


def validate(cal: Calibration, paths: list[str], world_min: int = 2) -> list[dict]:
    """Predicted vs measured step time and memory for every run under ``paths`` with at least
    ``world_min`` workers."""
    traces: dict = {}
    rows = []
    for s, link, label in _measured_runs(paths):
        if s["world_size"] < world_min or not s.get("time_per_step_s_median"):
            continue
        lay = layout_of(s)
        p = predict(_trace_for(s, traces), lay, link, cal)
        measured = s["time_per_step_s_median"]
        mem = s.get("model_state_bytes_per_rank")
        rows.append({"run": label, "model": s["model"], "world_size": s["world_size"], "link": link.name,
                     "dp_sync": lay.dp_sync, "zero": lay.zero, "tp": lay.tp, "local_batch_size": s["local_batch_size"],
                     "measured_step_s": measured, "predicted_step_s": p["step_s"],
                     "time_rel_err": (p["step_s"] - measured) / measured,
                     "predicted_compute_s": p["compute_s"], "predicted_exposed_comm_s": p["exposed_comm_s"],
                     "measured_model_state_bytes": mem, "predicted_model_state_bytes": p["model_state_bytes_per_rank"],
                     "memory_exact": p["model_state_exact"],
                     "memory_rel_err": (p["model_state_bytes_per_rank"] - mem) / mem if mem else None})
    if not rows:
        raise ConfigError(f"no runs with {world_min}+ workers under {', '.join(paths)} (run directories with "
                          f"summary.json, or bench scaling JSON)")
    return rows


def summarize(rows: list[dict]) -> dict:
    errs = [abs(r["time_rel_err"]) for r in rows]
    mem = [abs(r["memory_rel_err"]) for r in rows if r["memory_rel_err"] is not None and r["memory_exact"]]
    return {"runs": len(rows), "median_abs_time_err": statistics.median(errs), "max_abs_time_err": max(errs),
            "memory_exact_runs": sum(1 for m in mem if m == 0), "memory_checked_runs": len(mem),
            "max_abs_memory_err": max(mem) if mem else None}


# ---------------------------------------------------------------------------------- sweep

def sweep(t: Trace, base: Layout, worlds: list[int], link: Link, cal: Calibration | None,
          device_memory: int | None, strategies: list[dict]) -> list[dict]:
    """Predictions for each strategy (a dict of Layout overrides) at each data-parallel world size
    (the global batch grows with it: weak scaling), with whether it fits in ``device_memory``."""
    rows = []
    per_rank = base.global_batch // base.dp
    for strat in strategies:
        for n in worlds:
            lay = replace(base, dp=n, global_batch=per_rank * n, **strat)
            p = predict(t, lay, link, cal)
            p["fits"] = device_memory is None or p["memory_bytes_per_rank"] <= device_memory
            p["strategy"] = strat
            rows.append(p)
    return rows


# ---------------------------------------------------------------------------------- text

def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.3g} GiB" if b >= 2**30 else f"{b / 2**20:.3g} MiB"


def _ms(s) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s" if s < 600 else f"{s / 3600:.3g} h"


def format_prediction(p: dict) -> str:
    lay = p["layout"]
    lines = [f"layout        dp {lay['dp']} x tp {lay['tp']} = {lay['world_size']} ranks, zero {lay['zero']}, "
             f"{lay['dp_sync']}/{lay['collective']}, global batch {lay['global_batch_size']}, "
             f"grad accum {lay['grad_accum']}, {lay['optimizer']}",
             f"link          {p['link']['name']}" + (f", latency {p['link']['latency_s'] * 1e6:.3g} us"
                                                     if p['link']['latency_s'] else ""),
             f"parameters    {p['num_parameters']:,}",
             f"at rest       parameters {_gib(p['parameter_bytes_per_rank'])}, gradients "
             f"{_gib(p['gradient_bytes_per_rank'])}, optimizer state {_gib(p['optimizer_bytes_per_rank'])} per rank",
             f"model state   {_gib(p['model_state_bytes_per_rank'])} per rank "
             f"({'exact: what distlab will measure' if p['model_state_exact'] else 'estimate'}; "
             f"{p['model_state_bytes_per_rank']:,} bytes: parameters + gradients + optimizer state at their peak)",
             f"activations   {_gib(p['activation_bytes_per_rank'])} per rank (estimate, one micro-batch)",
             f"memory        {_gib(p['memory_bytes_per_rank'])} per rank"]
    if "step_s" in p:
        lines += [f"compute       {_ms(p['compute_s'])} per step ({p['threads_per_rank']} threads per rank"
                  + (f", {p['oversubscription']:.2g}x oversubscribed" if p["oversubscription"] > 1 else "") + ")",
                  f"communication {_ms(p['comm_s'])} per step, {_ms(p['exposed_comm_s'])} of it exposed",
                  f"step          {_ms(p['step_s'])}: {p['samples_per_s']:,.0f} samples/s, "
                  f"scaling efficiency {p['scaling_efficiency']:.2f}"]
    else:
        lines.append("time          no calibration given: memory only (`distlab plan calibrate` makes one)")
    return "\n".join(lines)


def _strategy_name(s: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in s.items()) or "as given"


def format_sweep(rows: list[dict], min_efficiency: float = 0.5) -> str:
    timed = "step_s" in rows[0]
    w = max(8, *(len(_strategy_name(r["strategy"])) for r in rows))
    head = f"{'strategy':<{w}} {'ranks':>6} {'memory/rank':>12} {'fits':>4}" + (
        f" {'step':>10} {'samples/s':>12} {'eff':>5}" if timed else "")
    lines = [head]
    verdicts = []
    for name in dict.fromkeys(_strategy_name(r["strategy"]) for r in rows):
        mine = [r for r in rows if _strategy_name(r["strategy"]) == name]
        for r in mine:
            line = f"{name:<{w}} {r['layout']['world_size']:>6} {_gib(r['memory_bytes_per_rank']):>12} " \
                   f"{'yes' if r['fits'] else 'NO':>4}"
            if timed:
                line += f" {_ms(r['step_s']):>10} {r['samples_per_s']:>12,.0f} {r['scaling_efficiency']:>5.2f}"
            lines.append(line)
        fit = [r["layout"]["world_size"] for r in mine if r["fits"]]
        no_fit = [r["layout"]["world_size"] for r in mine if not r["fits"]]
        words = []
        if not fit:
            words.append("never fits in memory")
        elif no_fit:
            words.append(f"fits from {min(fit)} ranks" if min(no_fit) < min(fit) else f"stops fitting at {min(no_fit)} ranks")
        else:
            words.append("fits at every size")
        if timed:
            low = [r["layout"]["world_size"] for r in mine if r["scaling_efficiency"] < min_efficiency]
            words.append(f"stops scaling (efficiency < {min_efficiency:.2g}) at {min(low)} ranks" if low
                         else f"scales (efficiency >= {min_efficiency:.2g}) to {max(r['layout']['world_size'] for r in mine)}")
        verdicts.append(f"{name}: " + "; ".join(words))
    return "\n".join(lines + [""] + verdicts)


def format_validation(rows: list[dict], summary: dict) -> str:
    lines = [f"{'run':<34} {'N':>2} {'link':<8} {'measured':>10} {'predicted':>10} {'error':>7} {'state bytes':>13} "
             f"{'predicted':>13}"]
    for r in rows:
        lines.append(f"{r['run'][:34]:<34} {r['world_size']:>2} {r['link']:<8} {_ms(r['measured_step_s']):>10} "
                     f"{_ms(r['predicted_step_s']):>10} {r['time_rel_err']:>+7.1%} "
                     f"{r['measured_model_state_bytes'] or 0:>13,} {r['predicted_model_state_bytes']:>13,}")
    lines.append(f"step time: median |error| {summary['median_abs_time_err']:.1%}, max {summary['max_abs_time_err']:.1%} "
                 f"over {summary['runs']} runs; memory: {summary['memory_exact_runs']} of "
                 f"{summary['memory_checked_runs']} exact")
    return "\n".join(lines)


STRATEGY_KEYS = {"dp_sync": str, "zero": int, "tp": int, "collective": str, "grad_accum": int, "bucket_mb": float}


def parse_strategy(text: str) -> dict:
    """``zero=3``, ``dp_sync=allreduce+collective=ring`` -> Layout overrides."""
    out = {}
    for part in text.split("+"):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in STRATEGY_KEYS or not value:
            raise ConfigError(f"--strategies: {part!r} is not KEY=VALUE with KEY one of {', '.join(STRATEGY_KEYS)}")
        try:
            out[key] = STRATEGY_KEYS[key](value)
        except ValueError:
            raise ConfigError(f"--strategies: {part!r}: {value!r} is not a {STRATEGY_KEYS[key].__name__}") from None
    return out
