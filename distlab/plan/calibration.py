"""Calibration of :mod:`distlab.plan`'s cost model: what was fitted on this machine, and from what.

``calibrate(paths)`` reads ``distlab bench collectives`` JSON (an alpha-beta fit per algorithm
from the runs that had a core per rank, and one per algorithm and world size from all of them)
and one-worker training runs -- run directories or ``bench scaling`` JSON -- (a compute rate per
threads-per-rank). The result is stored as JSON with the machine, date and sources.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from distlab.data import dataset_shape
from distlab.errors import ConfigError, first_line
from distlab.plan.machine import AlphaBeta, Compute, fit_alpha_beta, fit_compute, rounds, volume
from distlab.plan.trace import Trace, trace


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
        except OSError as exc:
            raise ConfigError(f"calibration {path} cannot be read ({exc.strerror or exc})") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise ConfigError(f"calibration {path} is not a valid calibration file ({exc}); make it again with "
                              f"`distlab plan calibrate`") from None

    def to_json(self) -> str:
        """The calibration file's text (``distlab plan calibrate`` writes it atomically)."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def alpha_beta(self, algorithm: str, world: int | None = None) -> AlphaBeta:
        """The fit for ``algorithm``; with ``world``, the one measured at that world size if any (for
        runs that share this machine's cores the way the bench's ranks did)."""
        if world is not None and (algorithm, world) in self.by_world:
            return self.by_world[algorithm, world]
        if algorithm in self.collectives:
            return self.collectives[algorithm]
        raise ConfigError(f"the calibration has no {algorithm!r} collective measurements (it has "
                          f"{', '.join(self.collectives) or 'none'}): calibrate again with the results of "
                          f"`distlab bench collectives --algorithms {algorithm}`")

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
        return replace(c, rate=c.rate * threads / near, threads=threads, scaled_from=near)


def json_files(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.json") if q.name in ("collectives.json", "summary.json",
                                                                        "scaling.json", "compression.json"))
        elif p.exists():
            found.append(p)
        else:
            raise ConfigError(f"{p} not found")
    return found


def load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({first_line(exc, 200)})") from None


def run_summary(bench_json: Path, run_dir: str) -> Path | None:
    """A bench record's run directory: the one under the bench file's own ``runs/`` (where bench
    writes it; found after the whole directory is moved or copied), else where it was written."""
    for d in (bench_json.parent / "runs" / Path(run_dir).name, Path(run_dir)):
        if (d / "summary.json").exists():
            return d / "summary.json"
    return None


def summary_flops(summary: dict, traces: dict) -> float:
    t = trace_for(summary, traces)
    return t.flops_per_sample * summary["local_batch_size"] / max(1, summary.get("strategy", {}).get("tp") or 1)


def plannable(summary: dict) -> bool:
    """Whether ``summary``'s model can be traced: a registered one. A run of the user's own model
    (``file.py:build``) is skipped: a summary.json is data, and the code it names is not run."""
    from distlab.models import is_user_model
    return not is_user_model(str(summary.get("model", "")))


def trace_for(summary: dict, traces: dict) -> Trace:
    if not plannable(summary):
        raise ConfigError(f"the run of {summary.get('model')} cannot be planned from its summary: its model is code "
                          f"of the user's, which distlab does not run from a data file")
    shape, k = (tuple(summary["input_shape"]), summary["num_classes"]) if "input_shape" in summary else \
        dataset_shape(summary["dataset"])
    from distlab.models import check_model_name, spec
    cfg = summary.get("config", {})
    names = spec(check_model_name(summary["model"])).options.names()  # the family's options the run recorded
    sizes = {name: tuple(v) if isinstance(v, list) else v for name, v in cfg.items() if name in names}
    adapters = cfg.get("lora") if isinstance(cfg.get("lora"), str) else None  # a LoRA run's spec: the base frozen
    base = (cfg.get("base_dtype") or "float32") if adapters else "float32"  # (and its frozen base's dtype)
    key = (summary["model"], shape, k, tuple(sorted(sizes.items())), adapters, base)
    if key not in traces:
        from distlab.models.lora import LoRASpec
        traces[key] = trace(summary["model"], shape, k, lora=LoRASpec.of(adapters), base_dtype=base, **sizes)
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
    for path in json_files(paths):
        data = load_json(path)
        if isinstance(data, list) and data and isinstance(data[0], dict) and "algorithm" in data[0]:
            sources.append(str(path))
            # this machine's host stack: runs over loopback only (a record with a link ran across nodes)
            summed = [r for r in data if r.get("op", "sum") in ("sum", "avg") and r.get("link") in (None, "loopback")]
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
                    s = run_summary(path, r["run_dir"])
                    if s is not None:
                        summaries.append((s, load_json(s)))
        for spath, s in summaries:
            if s.get("world_size") != 1 or not s.get("time_per_step_s_median") or str(spath.resolve()) in seen_runs \
                    or not plannable(s):
                continue
            seen_runs.add(str(spath.resolve()))
            sources.append(str(spath))
            comp.setdefault(int(s.get("threads_per_rank") or 1), []).append(
                (summary_flops(s, traces), s["time_per_step_s_median"]))
    if not coll and not comp:
        raise ConfigError(f"no bench collectives JSON or one-worker training runs under {', '.join(paths)}")
    machine = {"host": socket.gethostname(), "cores": os.cpu_count(), "torch_version": torch.__version__,
               "device": "cuda" if torch.cuda.is_available() and os.environ.get("DISTLAB_DEVICE") != "cpu" else "cpu",
               "python_version": platform.python_version(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return Calibration({a: fit_alpha_beta(v) for a, v in coll.items()},
                       {k: fit_compute(v, k) for k, v in comp.items()}, machine, sources,
                       {k: fit_alpha_beta(v) for k, v in per_world.items()})
