"""What a run carries across snapshots and restarts: step, history, evaluations, best model, time used.

:class:`RunState` owns the snapshot side of training (save every ``snapshot_every`` steps and at
the end, resume from ``resume`` or after a torchrun restart) and the time budget (stop before one
more step, the final evaluation and snapshot would overrun ``time_budget``, counted across
restarts). The training loop asks it two questions -- :meth:`RunState.out_of_time` and
:meth:`RunState.snapshot_due` -- and tells it what happened (:meth:`RunState.advance`,
:meth:`RunState.record_eval`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import sys
import time
import uuid
from typing import Callable

import torch
import torch.distributed as dist

from distlab.errors import ConfigError, first_line
from distlab.parallel import Engine, Strategy
from distlab.parallel.placement import placement_of
from distlab.runtime import Runtime, reduce_scalars, timeline
from distlab.runtime.launch import parent_pid
from distlab.train import lock, reshard, snapshot, snapshot_load
from distlab.train.async_snapshot import AsyncWriter, host_copy
from distlab.train.config import TrainConfig
from distlab.train.optim import optimizer_index
from distlab.train.registry import StateRegistry
from distlab.train.run_dirs import directory_problem, last_logged_step
from distlab.train.snapshot import SnapshotError


RESHARDABLE = ("world_size", "strategy")  # a snapshot may differ from the run in these: it is resharded


def restart_count() -> int:
    """How often torchrun's agent restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def fingerprint(layout: dict) -> str:
    """A short hash of what a snapshot must agree on to be resumed (the run's configuration)."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def fault_injection_hook(rank: int) -> Callable[[int], None] | None:
    """Test hooks, on the first attempt only (real, unannounced signals for the fault-tolerance tests):
    ``DISTLAB_KILL_AT_STEP=RANK:STEP`` SIGKILLs that rank right after that step;
    ``DISTLAB_TERM_AGENT_AT_STEP=RANK:STEP`` makes it send SIGTERM to its parent (torchrun's agent,
    which passes it on to every worker: a preemption) and to itself, as a scheduler signals every process of
    a job -- so the run stops within two steps however late the agent's signals come (this rank then has
    two). None when neither names this rank."""
    hooks = []
    for variable, target, sig in (("DISTLAB_KILL_AT_STEP", os.getpid, signal.SIGKILL),
                                  ("DISTLAB_TERM_AGENT_AT_STEP", parent_pid, signal.SIGTERM),
                                  ("DISTLAB_TERM_AGENT_AT_STEP", os.getpid, signal.SIGTERM)):
        spec = os.environ.get(variable)
        if not spec or restart_count() > 0:
            continue
        victim, at = (int(v) for v in spec.split(":"))
        if victim == rank:
            hooks.append((at, target, sig))
    if not hooks:
        return None

    def hook(step: int) -> None:
        for at, target, sig in hooks:
            if step == at:
                os.kill(target(), sig)

    return hook


def time_to_finish(step_times: list[float], warmup: int, eval_steps: float, eval_s: float | None,
                   snapshot_s: float, budget: float) -> float:
    """Seconds to keep for the end of a run with a time budget: one more step, the final evaluation
    and snapshot, and a margin (the summary; ranks whose clocks stop last).

    The step counts as the slowest of the last 20 -- on a loaded machine steps are not all the typical
    one, and a budget overrun by one slow step is one a scheduler kills. The first ``warmup`` steps
    (allocation, first collectives) are left out once later ones exist. An evaluation not timed yet is
    estimated from the typical step: a forward pass costs about a third of a training step per sample; while
    only warm-up steps exist, the typical one is of those after the first (none after the first alone).
    """
    steady = step_times[warmup:] if len(step_times) > warmup else step_times
    recent = steady[-20:]
    slowest = max(recent) if recent else 0.0
    # The evaluation never from the first step while it is among the few timed (it compiles, allocates,
    # connects: often 100x the next ones); after it alone, the step kept for covers the wait for a second.
    later = recent if len(step_times) > warmup else step_times[1:][-20:]
    typical = statistics.median(later) if later else 0.0
    evaluation = eval_s if eval_s is not None else typical * eval_steps / 3
    return slowest + evaluation + snapshot_s + max(0.02 * budget, 0.2)


class RunState:
    """Step, logged history, evaluations, best validation model, time used; saved in every snapshot."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, engine: Engine, optimizer, scheduler, layout: dict,
                 eval_samples: int, attachments: dict | None = None):
        self.cfg, self.rt, self.engine = cfg, rt, engine
        self.optimizer, self.scheduler = optimizer, scheduler
        self.layout = layout  # what a snapshot must agree on to be resumed by this run
        self.attachments = dict(attachments or {})  # kept in meta.json for readers (the tokenizer), not compared
        self.eval_samples = eval_samples  # test (+ validation) samples, for the time-budget estimate
        self.restart_count = restart_count()
        self.restarted = False  # any rank's agent restarted the group (begin() agrees on it)
        self.run_id: str | None = None  # who wrote a snapshot: set by begin(), kept across resumes
        self.fingerprint = fingerprint(layout)
        self.step = 0
        self.history: list[dict] = []  # the logged records (every rank has them)
        self.evals: list[dict] = []
        self.best_val_loss: float | None = None
        self.best_val_step: int | None = None
        self.best_state: dict | None = None
        self.last_loss = float("nan")
        self.attempts = 0
        self.layouts: list[dict] = []  # per attempt: the step it began at, its world size and strategy
        self.resharded_from: dict | None = None  # this attempt's snapshot's layout, when it differed
        self._placement: dict | None = None
        self.window_loss, self.window_steps = 0.0, 0  # training loss since the last log line
        self.resumed_from: str | None = None
        self.last_snapshot: str | None = None
        self.unwritten: str | None = None  # why a snapshot due was not written (weights not finite)
        self._saved_step: int | None = None
        self._snapshot_s: float | None = None  # seconds the last snapshot took (None: none yet)
        self.snapshot_stalls: list[float] = []  # seconds each snapshot of this attempt held the training up
        self._writer = AsyncWriter(cfg) if cfg.snapshot_async and cfg.snapshot_dir else None
        self._eval_s: float | None = None
        # where the time budget stopped the run: the time used then and what it kept for the end (one more
        # step, the final evaluation and snapshot, the margin) -- the summary says both
        self.budget_stop: tuple[float, float] | None = None
        self._time_before = 0.0  # training time of earlier attempts
        self._start = time.perf_counter()
        self._locked: list[str] = []  # directories this process locked (released by end())
        self._resumed_note: str | None = None
        self._loading = None  # the snapshot being loaded (named by errors)
        self.registry = self._registry()

    def _registry(self) -> StateRegistry:
        """Every piece of state a snapshot keeps, by name (a payload's keys), in loading order."""
        reg, engine = StateRegistry(), self.engine
        reg.register("model", engine.sharded_state_dict, self._load_model, reshard="layout")
        reg.register("placement", lambda: self.placement)  # read by a resume under another layout
        reg.register_stateful("optimizer", self.optimizer, reshard="layout")
        reg.register_stateful("scheduler", self.scheduler)
        extra = StateRegistry()
        engine.register_state(extra)  # compression memory, loss scaler
        reg.register_registry("extra", extra, optional=True)
        reg.register("step", lambda: self.step, self._load_step)
        reg.register("samples", lambda: self.step * self.cfg.global_batch_size)
        reg.register("window", lambda: [float(self.window_loss), self.window_steps], self._load_window, reshard="all")
        reg.register("run", self._run_fields, self._load_run_fields)
        reg.register("best_model", lambda: self.best_state, self._load_best, reshard="layout", optional=True)
        reg.register("rng", snapshot.rng_state, snapshot.set_rng_state, reshard="mine")  # last: nothing after draws
        return reg

    # ------------------------------------------------------------------ start and progress

    def begin(self) -> None:
        """Resume if asked (or after a restart), count this attempt and start its clock."""
        # Restarted if any rank's agent restarted it: a node that joins an elastic job later starts its
        # workers at restart count 0 while the others' count on -- they all resume together.
        self.restarted = reduce_scalars([float(self.restart_count > 0)], dist.ReduceOp.MAX,
                                        device=self.rt.device)[0] > 0
        self._hold_directories()  # one run per directory, before anything in them is read or moved
        self.resumed_from = self._restore()
        if self.resumed_from is None:
            self.run_id = snapshot.broadcast_object(uuid.uuid4().hex[:12])  # one id on every rank
        # A fresh first attempt checks its output too; a restarted group may rewrite its own.
        fresh = self.resumed_from is None and not self.restarted
        problem = directory_problem(self.cfg.snapshot_dir, self.cfg.out, self.run_id, fresh, self.history) \
            if self.rt.is_main else None
        problem = snapshot.broadcast_object(problem)
        if problem:
            raise SnapshotError(problem)
        if self.rt.is_main:
            for directory in (self.cfg.snapshot_dir, self.cfg.out):
                lock.note_run(directory, self.run_id)
            if self._resumed_note:
                print(self._resumed_note, file=sys.stderr, flush=True)
        self.attempts += 1
        entry = {"attempt": self.attempts, "step": self.step, "world_size": self.rt.world_size,
                 "strategy": str(self.cfg.strategy)}
        if self.resumed_from is not None and self.rt.is_main:
            logged = last_logged_step(self.cfg.out)
            if logged is not None:  # steps the attempt before reached (as far as it logged) that are done again
                entry["lost_steps"] = max(0, logged - self.step)
        self.layouts.append(entry)
        self._start = time.perf_counter()

    def _hold_directories(self) -> None:
        """Rank 0 locks ``snapshot_dir``, ``out`` and ``tensorboard`` unless this process or its launcher
        holds them already (a launching command takes them before its workers start); every rank hears a
        refusal."""
        problem = None
        if self.rt.is_main:
            try:
                for directory, flag in ((self.cfg.snapshot_dir, "snapshot_dir"), (self.cfg.out, "out"),
                                        (self.cfg.tensorboard, "tensorboard")):
                    if lock.hold(directory, flag=flag):
                        self._locked.append(directory)
            except ConfigError as exc:
                problem = str(exc)
        problem = snapshot.broadcast_object(problem)
        if problem:
            self.end()
            raise SnapshotError(problem)

    def end(self) -> None:
        """Release the directories this process locked (the run is over, or failed)."""
        while self._locked:
            lock.release(self._locked.pop())

    @property
    def placement(self) -> dict:
        """Where this rank's tensors sit in the whole model (saved with every snapshot; fixed for a run)."""
        if self._placement is None:  # with the optimizer's numbering of each parameter (its groups' order)
            self._placement = {**placement_of(self.engine),
                               "optimizer_index": optimizer_index(self.optimizer, self.engine.parameters())}
        return self._placement

    def time_used(self) -> float:
        """Training time over every attempt: the snapshot's count plus this attempt's."""
        return self._time_before + (time.perf_counter() - self._start)

    def advance(self, loss: float | torch.Tensor) -> None:
        """One more step of this rank's mean ``loss`` (a float, or a 0-dim tensor read only when the
        window closes or a snapshot is written: no wait for the device per step)."""
        self.step += 1
        self.window_loss = self.window_loss + loss
        self.window_steps += 1

    def close_window(self, keep: bool = False) -> float:
        """The global mean training loss since the last call (local means averaged over ranks). ``keep``:
        the window stays open (a line the run logs only because it ends here): a snapshot then holds its
        partial sums, and a resume that goes on logs the next ``log_every`` step as the uninterrupted run
        does, over the same steps."""
        total, = reduce_scalars([float(self.window_loss)], device=self.rt.device)
        self.last_loss = total / (self.window_steps * self.rt.world_size)
        if not keep:
            self.window_loss, self.window_steps = 0.0, 0
        return self.last_loss

    def going_on(self) -> None:
        """A resumed run that trains further: the line its last attempt logged only because it ended there
        (``end_of_run``) is not one the uninterrupted run logged -- it leaves the history (and
        metrics.jsonl), and its window goes on (:meth:`close_window`)."""
        if self.history and self.history[-1].get("end_of_run") and self.history[-1]["step"] == self.step:
            self.history.pop()

    def record_eval(self, record: dict, seconds: float) -> None:
        """Keep an evaluation; a new best validation loss also keeps its model (every rank's shard when
        ranks hold different states, rank 0's copy otherwise)."""
        self.evals.append(record)
        self._eval_s = seconds
        val = record.get("val_loss")
        if val is not None and (self.best_val_loss is None or val < self.best_val_loss):
            self.best_val_loss, self.best_val_step = val, self.step
            if self.engine.sharded or self.rt.is_main:
                self.best_state = self.engine.sharded_state_dict()

    # ------------------------------------------------------------------ time budget

    def out_of_time(self, step_times: list[float]) -> bool:
        """Would one more step, then the final evaluation and snapshot, overrun ``time_budget``?

        Collective when a budget is set (one scalar all-reduce, MAX) so every rank stops at the same step.
        """
        budget = self.cfg.time_budget_s
        if budget is None:
            return False
        # before the first snapshot: its bytes at a slow disk's 100 MB/s
        snapshot_s = self._snapshot_s if self._snapshot_s is not None else self.engine.peak_bytes / 1e8
        left = time_to_finish(step_times, self.cfg.timing_warmup_steps,
                              self.eval_samples / self.cfg.global_batch_size, self._eval_s, snapshot_s, budget)
        used = self.time_used()
        need, = reduce_scalars([used + left], op=dist.ReduceOp.MAX, device=self.rt.device)
        if need >= budget:
            self.budget_stop = (used, need - used)
        return need >= budget

    # ------------------------------------------------------------------ snapshots

    def snapshot_due(self, total_steps: int) -> bool:
        """Whether ``snapshot_every`` asks for a snapshot at this step (not at the end: :meth:`final_snapshot`
        writes that one); the trainer then calls :meth:`save`."""
        every = self.cfg.snapshot_every
        return bool(every) and self.step % every == 0 and self.step < total_steps

    def _weights_finite(self) -> bool:
        """Whether every rank's trained weights are finite (one pass over them and one all-reduce of a flag; a
        frozen weight never changes)."""
        params = [p.detach() for p in self.engine.parameters() if p.requires_grad]
        bad = torch.zeros((), device=self.rt.device) if not params else \
            torch.stack([torch.isfinite(p).all().logical_not() for p in params]).any().float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad)

    def final_snapshot(self) -> None:
        if self.cfg.snapshot_dir and self._saved_step != self.step:
            self.save()
        self.settle()  # the last one is on disk before the summary names it

    def _run_fields(self) -> dict:
        return {"history": self.history, "evals": self.evals, "best_val_loss": self.best_val_loss,
                "best_val_step": self.best_val_step, "time_used_s": self.time_used(), "last_loss": self.last_loss,
                "attempts": self.attempts, "layouts": self.layouts}

    def _load_run_fields(self, run: dict) -> None:
        self.history = list(run["history"])
        self.evals = list(run["evals"])
        self.best_val_loss, self.best_val_step = run["best_val_loss"], run["best_val_step"]
        self.last_loss, self.attempts = run["last_loss"], run["attempts"]
        self.layouts = list(run.get("layouts", []))
        self._time_before = run["time_used_s"]

    def _load_model(self, state: dict) -> None:
        try:
            self.engine.load_sharded_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise SnapshotError(f"snapshot {self._loading} holds another model than this run's: "
                                f"{first_line(exc)[:300]}") from None

    def _load_step(self, step: int) -> None:
        self.step = self._saved_step = int(step)

    def _load_window(self, windows: list) -> None:
        """Each rank's share of the loss sum since the last log line (on another layout: the old
        ranks' sum spread evenly, so the logged mean stays the global mean)."""
        self.window_loss = sum(float(w[0]) for w in windows) / len(windows)
        self.window_steps = int(windows[0][1])

    def _load_best(self, state: dict) -> None:
        self.best_state = state

    def save(self) -> None:
        """Snapshot the run at this step. ``snapshot_async``: copy the state to host memory here and write
        it in the background (:class:`AsyncWriter`), the previous write finished first (at most one in
        flight); the training stalls for the copy only."""
        if not self._weights_finite():  # an update overflowed (too large a learning rate): no state worth keeping
            self.unwritten = (f"no snapshot of step {self.step}: its weights hold nan or inf (that step's update "
                              f"overflowed: lower the learning rate)")
            return
        t0 = time.perf_counter()
        with timeline.span("snapshot (copy to host memory)" if self._writer is not None else "snapshot"):
            if self._writer is not None:
                self.last_snapshot = self._writer.wait() or self.last_snapshot  # its error, if it failed, here
            payload = self.registry.state_dict()
            meta = {**self.attachments, "run_id": self.run_id, "fingerprint": self.fingerprint, **self.layout}
            if self._writer is not None:
                self._writer.start(self.step, host_copy(payload), meta)
            else:
                self.last_snapshot = str(snapshot.save(self.cfg.snapshot_dir, self.step, payload, meta,
                                                       self.cfg.keep_snapshots))
        self._saved_step = self.step
        self._snapshot_s = time.perf_counter() - t0
        self.snapshot_stalls.append(self._snapshot_s)

    def settle(self) -> None:
        """Wait for a background snapshot still being written (collective: every rank calls it)."""
        if self._writer is not None:
            self.last_snapshot = self._writer.wait() or self.last_snapshot

    def _restore(self) -> str | None:
        """Load the snapshot ``resume`` names (``auto``: the newest good one), if any; return its path.

        Without ``resume``, a group that torchrun restarted after a failure (its
        ``TORCHELASTIC_RESTART_COUNT`` > 0) resumes ``auto`` from ``snapshot_dir``.
        """
        cfg = self.cfg
        target = cfg.resume
        if target is None and cfg.snapshot_dir and self.restarted:
            target = "auto"
        if target is None:
            return None
        warn = (lambda m: print(m, file=sys.stderr, flush=True)) if self.rt.is_main else (lambda m: None)
        loaded = snapshot_load.resume(target, cfg.snapshot_dir, self.layout, on_warning=warn, reshardable=RESHARDABLE,
                                 accept=self._load)
        if loaded is None:
            warn(f"distlab: no snapshot in {cfg.snapshot_dir} yet: starting from step 0")
            return None
        self.run_id = loaded.meta.get("run_id")
        if self.rt.is_main and cfg.verbose:
            how = ""
            if loaded.resharded:
                was = self.resharded_from
                how = (f", resharded from {was['world_size']} ranks ({was['strategy']}) to {self.rt.world_size} "
                       f"({cfg.strategy})")
            self._resumed_note = f"resumed from {loaded.path} at step {self.step}{how}"  # said once begin() agrees
        return str(loaded.path)

    def _load(self, loaded: snapshot_load.Loaded) -> str | None:
        """Load ``loaded`` into the run; what makes it unusable (None: nothing). Everything it sets is set
        again by the next snapshot tried, so a refused one leaves nothing behind."""
        self._loading = loaded.path
        if loaded.resharded:
            self._reshard(loaded)  # the layout-cut state: model, optimizer, best model
        try:  # every registered piece by its name (old rank 0's payload when resharding; the rest by their rules)
            self.registry.load_state_dict(loaded.payload, loaded.payloads if loaded.resharded else None, self.rt.rank)
        except (ConfigError, RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
            return f"does not load into this run: {first_line(exc, 200)}"  # (SnapshotError is a ConfigError)
        for group in self.optimizer.param_groups:  # element-wise state (momentum, Adam's moments) fits its parameter
            for p in group["params"]:
                for name, value in self.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and name != "step" and value.shape != p.shape:
                        return (f"holds optimizer state {name} of shape {tuple(value.shape)} for a parameter of "
                                f"shape {tuple(p.shape)}")
        return None

    def _reshard(self, loaded: snapshot_load.Loaded) -> None:
        """Load a snapshot written under another world size or strategy (every old rank's payload)."""
        meta = loaded.meta
        self.resharded_from = {"world_size": meta.get("world_size"),
                               "strategy": str(Strategy.from_dict(meta["strategy"]))
                               if isinstance(meta.get("strategy"), dict) else str(meta.get("strategy"))}
        try:
            best = reshard.load(self.engine, self.optimizer, loaded.payloads)
        except (reshard.ReshardError, KeyError, ValueError, RuntimeError) as exc:
            first = first_line(exc)
            raise SnapshotError(f"snapshot {loaded.path} (written by {meta.get('world_size')} ranks) cannot be "
                                f"resharded to this run's layout: {first[:300]}") from None
        if self.engine.sharded or self.rt.is_main:
            self.best_state = best
