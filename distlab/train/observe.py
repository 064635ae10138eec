"""What a run records about its own steps, on request: ``--trace A:B`` (every rank's timeline of those
steps, :mod:`distlab.runtime.timeline`, into OUT/trace.json) and ``--profile A:B`` (torch.profiler over
them, one trace per rank in OUT/profile/). The Trainer calls :meth:`StepObserver.before` and
:meth:`~StepObserver.after` around every step and :meth:`~StepObserver.finish` after its loop; both
cost a comparison per step when neither is asked for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from distlab.errors import ConfigError
from distlab.plan import timeline_analysis
from distlab.runtime import timeline, trace_file
from distlab.train.metrics import atomic_write_text


class StepObserver:
    """The trace and the profile of a run's steps (each off unless its setting names steps)."""

    def __init__(self, cfg, rt, engine, say: Callable[[str], None]):
        self.cfg, self.rt, self.engine, self.say = cfg, rt, engine, say
        self.traced = cfg.trace_steps() if cfg.trace else None
        self.profiled = cfg.trace_steps("profile") if cfg.profile else None
        profile_dir = Path(cfg.out) / "profile" if cfg.profile and cfg.out else None
        if profile_dir is not None and profile_dir.exists() and not profile_dir.is_dir():
            raise ConfigError(f"`profile` writes one trace per rank into {profile_dir}/, and {profile_dir} is a file: "
                              f"move it, or give another `out`")
        self.trace_record: dict | None = None  # where the timeline went, its steps, spans, clock and reading
        self.profile_record: dict | None = None  # where the per-rank profiler traces went
        self._profiler = None
        self._block_hooks: list = []

    def unreached(self, total_steps: int) -> list[str]:
        """The header's warnings for steps asked for past the run's end (nothing would be written for them)."""
        out = []
        for setting, steps in (("trace", self.traced), ("profile", self.profiled)):
            if steps and steps[0] > total_steps:
                out.append(f"--{setting} {steps[0]}:{steps[1]} starts after the run's last step ({total_steps}): "
                           f"nothing will be {'traced' if setting == 'trace' else 'profiled'}")
            elif steps and steps[1] > total_steps:
                out.append(f"--{setting} {steps[0]}:{steps[1]} ends after the run's last step ({total_steps}): "
                           f"steps {steps[0]}-{total_steps} are {'traced' if setting == 'trace' else 'profiled'}")
        return out

    def before(self, step: int) -> None:
        """Before optimizer step ``step`` (1-based): start what covers it."""
        if self.traced and self.traced[0] <= step <= self.traced[1] and not timeline.active():
            timeline.start(self.rt.rank, self.rt.device)
            self._block_hooks = timeline.trace_blocks(self._blocks())
        if self.profiled and self.profiled[0] <= step <= self.profiled[1] and self._profiler is None:
            self._start_profiler()

    def after(self, step: int) -> None:
        """After step ``step`` (its evaluation and snapshot included): write what ends there."""
        if self.traced and step == self.traced[1]:
            self._write_trace(self.traced)
        if self.profiled and step == self.profiled[1]:
            self._write_profile(self.profiled)

    def finish(self) -> None:
        """The run ended inside the traced or profiled steps: write what was recorded."""
        if timeline.active():
            self._write_trace(self.traced)
        if self._profiler is not None:
            self._write_profile(self.profiled)

    def _blocks(self) -> list[tuple[str, torch.nn.Module, torch.nn.Module, list]]:
        """The blocks a trace times one by one (name, first module, last module, its modules): the model's
        checkpointing blocks -- none where a pipeline stage (its own spans), activation checkpointing
        (a recomputation would time the block twice) or compiled blocks (hooks inside a graph) run them."""
        strategy = self.cfg.strategy
        if strategy.pp > 1 or strategy.activation_checkpointing or strategy.compile:
            return []
        from distlab.parallel.checkpointing import checkpoint_blocks
        model = self.engine.module
        try:
            blocks = checkpoint_blocks(model)
        except ConfigError:
            return []
        names = {id(m): n for n, m in model.named_modules()}
        out = []
        for container, ranges in blocks:
            for start, end in ranges:
                modules = list(container)[start:end]
                first, last = (_readable(names.get(id(m), "?"), m) for m in (modules[0], modules[-1]))
                out.append((first if first == last else f"{first}-{last}", modules[0], modules[-1], modules))
        return out

    def _write_trace(self, steps: tuple[int, int]) -> None:
        """Every rank's recorded spans, on rank 0's clock, into OUT/trace.json (collective)."""
        rec = timeline.stop()
        for handle in self._block_hooks:
            handle.remove()
        self._block_hooks = []
        offset, residual = timeline.clock_offset()
        mine = {"rank": self.rt.rank, "offset_ns": offset, "residual_ns": residual,
                "spans": rec.spans if rec is not None else []}
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        path = Path(self.cfg.out) / "trace.json"
        trace = trace_file.chrome_trace(everyone)
        shifted = any(r["offset_ns"] or r["residual_ns"] for r in everyone)
        trace["otherData"] = {"steps": list(steps), "clock_residual_us": max(r["residual_ns"] for r in everyone) / 1e3,
                              "clock": "monotonic clocks, other machines' shifted onto rank 0's by barrier releases"
                                       if shifted else "one machine's monotonic clock"}
        if self.rt.is_main:
            atomic_write_text(path, json.dumps(trace))
        found = timeline_analysis.analyze(trace)
        self.trace_record = {"path": str(path), "steps": list(steps), "ranks": len(everyone),
                             "spans": sum(len(r["spans"]) for r in everyone), **trace["otherData"],
                             **{k: found[k] for k in ("hidden_communication", "exposed_communication_s_per_step",
                                                      "slowest_rank", "pipeline_wait_fraction")},
                             "per_rank": found["ranks"]}
        clock = f"clocks aligned within {trace['otherData']['clock_residual_us']:.0f} us" if shifted else "one clock"
        hidden = found["hidden_communication"]
        self.say(f"trace of steps {steps[0]}-{steps[1]}: {path} ({self.trace_record['spans']} spans from "
                 f"{len(everyone)} ranks, {clock}" + (f"; {100 * hidden:.0f}% of communication hidden behind compute"
                                                      if hidden is not None else "") + ")")

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.rt.device.type == "cuda" else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        timeline.label_for_profiler(True)  # distlab's spans as ranges among torch's operators

    def _write_profile(self, steps: tuple[int, int]) -> None:
        """This rank's torch.profiler trace of the profiled steps: OUT/profile/rank-N.json."""
        timeline.label_for_profiler(False)
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        directory = Path(self.cfg.out) / "profile"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank-{self.rt.rank:05d}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(path)  # whole or absent
        self.profile_record = {"directory": str(directory), "steps": list(steps), "ranks": self.rt.world_size}
        self.say(f"profile of steps {steps[0]}-{steps[1]}: {directory}/rank-*.json (torch.profiler, one per rank)")



def _readable(name: str, module: torch.nn.Module) -> str:
    """A block's name in a span: its path in the model, or for a child of a Sequential model (a bare
    index) its class and index (``Block 3``)."""
    return f"{type(module).__name__} {name}" if name.isdigit() else name
