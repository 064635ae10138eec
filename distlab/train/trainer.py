"""The Trainer: build (data, model, engine, optimizer) and the training loop.

Every rank runs the same loop on its own slice of each global batch; only rank 0 writes files,
logs and draws the progress bar. What the loop needs from the strategy it gets from the
:class:`~distlab.parallel.Engine` (``parallelize``); what a run carries across snapshots and
restarts lives in :class:`~distlab.train.run_state.RunState`; ``summary.json`` is built by
:mod:`distlab.train.summary`.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from distlab import comm
from distlab.data.loader import TrainLoader
from distlab.data.resident import decide as decide_residence
from distlab.data.resident import nbytes as data_nbytes
from distlab.errors import ConfigError, FinalWriteError, NonFiniteError, first_line
from distlab.models.packing import moved, split
from distlab.parallel import Mesh
from distlab.parallel.placement import placement_of
from distlab.parallel.step_ahead import StepAhead
from distlab.runtime import Runtime, comm_failure, is_comm_failure, reduce_scalars, timeline, \
    tune_host_allocator
from distlab.train.clock import StepClock
from distlab.train.config import TrainConfig
from distlab.train.config_file import config_file_text
from distlab.train.evaluate import DEFAULT_EVAL_BATCH, EvaluationStopped, eval_batch, eval_words, evaluation_size, first_batches
from distlab.train.observe import StepObserver
from distlab.train import language
from distlab.train.metrics import (MetricsLog, anon_rss_mb, atomic_write_text, peak_rss_mb, write_predictions,
                                   write_summary)
from distlab.train.objective import objective_of
from distlab.train.muon import levels_of
from distlab.train.optim import build_optimizer, build_scheduler
from distlab.train.preemption import Preemption
from distlab.train.run_dirs import finished_summary
from distlab.train.run_state import RunState, fault_injection_hook
from distlab.train.header import header
from distlab.train.layout import run_layout
from distlab.train.materialize import materialize
from distlab.train.step_log import step_record, step_words
from distlab.train.summary import StepTimes, final_write_failed, summarize
from distlab.train.tensorboard import TensorBoardLog


READ_EVERY = 256  # the loop reads the device at least this often (the verdict, the steps' times)


class Trainer:
    """Builds data, model, engine and optimizer for ``cfg`` on runtime ``rt``; ``fit()`` trains and summarises.

    ``hooks``: callables run with the step number after every optimizer step (the fault-injection
    hook of the fault-tolerance tests is one, installed from the environment).
    """

    def __init__(self, cfg: TrainConfig, rt: Runtime, hooks: list[Callable[[int], None]] | None = None):
        self.cfg = cfg = cfg.validate(rt.world_size)
        self.rt = rt
        self.host_allocator = tune_host_allocator()  # before the data and the model take memory
        self.train_set, self.test_set = cfg.load("train"), cfg.load("test")
        self.val_set = None
        if cfg.val_fraction:  # a seeded, fixed split: the same on every rank and every restart
            n_val = max(1, round(cfg.val_fraction * len(self.train_set)))
            perm = torch.randperm(len(self.train_set), generator=torch.Generator().manual_seed(cfg.seed))
            self.val_set = self.train_set.subset(perm[:n_val].sort().values, "val")
            self.train_set = self.train_set.subset(perm[n_val:].sort().values, "train")
        # The data set in GPU memory when it fits (distlab.data.resident); the sampler is the same either way.
        sets = (self.train_set, self.test_set, self.val_set)
        self.data_resident, self.data_where = decide_residence(
            cfg.data_on_device, rt.device, data_nbytes(*sets), mapped=data_nbytes(*sets, mapped=True))
        if self.data_resident:
            self.train_set, self.test_set = self.train_set.to(rt.device), self.test_set.to(rt.device)
            self.val_set = self.val_set.to(rt.device) if self.val_set is not None else None
        # What each evaluation scores: every sample, or with --eval-batches the same first ones every time.
        mapped = bool(data_nbytes(*sets, mapped=True))  # a memory-mapped corpus: a bounded evaluation by default
        eval_size = evaluation_size(cfg.eval_batches, cfg.eval_batch_size or DEFAULT_EVAL_BATCH, cfg.global_batch_size,
                                    mapped)
        self.eval_test, self.eval_val = (first_batches(d, *eval_size) for d in (self.test_set, self.val_set))
        # The mesh: data is split over the data-parallel ranks only (a TP group and a pipeline see the same batch).
        self.mesh = Mesh.of(cfg.strategy)
        self.local_batch = cfg.global_batch_size // self.mesh.dp
        s = cfg.strategy
        logits = (cfg.block_size // s.cp) * -(-cfg.vocab(self.train_set.num_classes) // s.tp) * \
            self.test_set.inputs_per_sample  # a sample's logits on this rank (a preference pair: two windows)
        self.eval_batch = eval_batch(cfg.eval_batch_size, self.test_set.predicts_tokens,
                                     self.local_batch // (s.grad_accum * s.microbatches), logits)
        self.loader = TrainLoader(self.train_set, rank=self.mesh.dp_rank, world_size=self.mesh.dp,
                                  local_batch=self.local_batch, shuffle=True, seed=cfg.seed)
        if len(self.loader) == 0:
            raise ConfigError(f"`global_batch_size` {cfg.global_batch_size} is larger than the "
                              f"{len(self.train_set)} training samples of {cfg.dataset}")
        # The model, its fine-tuning converters applied, cut for the layout and given its values (one room).
        made = materialize(cfg, rt, self.train_set, self.mesh)
        self.engine, self.num_parameters, self.num_trainable = made.engine, made.num_parameters, made.num_trainable
        self.model_record, self.throughput, no_decay = made.record, made.throughput, made.no_decay
        self.narrow = made.narrow
        self.offload = made.offload  # --offload: the store the optimizer's state (and the shards) live in
        # What training minimises and evaluations score: the task's cross-entropy, or DPO's on preference pairs
        self.objective = objective_of(self)
        names = [p["name"] for p in placement_of(self.engine)["params"]] if no_decay or made.matrices else None
        levels = levels_of(self.engine) if made.matrices else None  # Muon: how each matrix is cut here
        # --offload-overlap: the offloaded steps on a thread, the next forward waiting for them (else none launched)
        self.ahead = StepAhead(self.engine.module if cfg.offload_overlap else None)
        # with a fused optimizer the gradients' verdict stays on the device, read where the loop must (_diverged)
        self.optimizer = self.engine.attach(build_optimizer(self.engine.parameters(), cfg, names, no_decay,
                                                            made.matrices, levels, made.offload, self.ahead),
                                            verdict_on_device=True)
        if cfg.ppo_epochs > 1:  # GRPO: each rollout batch trains ppo_epochs steps
            from distlab.train.grpo import Repeated
            self.loader = Repeated(self.loader, cfg.ppo_epochs)
        self.steps_per_epoch = len(self.loader)
        self.total_steps = cfg.total_steps(self.steps_per_epoch)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        eval_samples = len(self.eval_test) + (len(self.eval_val) if self.eval_val is not None else 0)
        self.tokenizer = getattr(self.train_set, "tokenizer", None)  # text: what made the tokens (bytes or BPE)
        self.run = RunState(cfg, rt, self.engine, self.optimizer, self.scheduler, run_layout(self), eval_samples,
                            attachments=language.attachments(cfg, self.tokenizer))
        self.hooks = list(hooks or []) + [h for h in [fault_injection_hook(rt.rank)] if h]
        show_bar = rt.is_main and (cfg.progress if cfg.progress is not None else sys.stderr.isatty())
        self.bar = tqdm(total=self.total_steps, disable=not show_bar, unit="step", dynamic_ncols=True,
                        desc=f"{cfg.model} x{rt.world_size}")
        self.say = self._printer(show_bar)
        self.log = MetricsLog(None)
        self.tb = TensorBoardLog(None, False, rt.device)
        self._window_s, self._window_timed = 0.0, 0  # training seconds and steps since the last log line
        self.already_finished = False  # fit() found the resumed run complete and changed nothing
        self.model_file = None  # where a language model's run without snapshots left its final model
        self._nonfinite = ""  # why the run stopped on non-finite gradients
        self.diverged_on_device = False  # ... found late, on the device's verdict: no final snapshot
        self._predictions = None  # (step, confusion matrix, misclassified rows) of the newest evaluation
        self._grad_norm = None  # the last step's gradient norm before clipping (a device tensor), with clipping
        self._clipped = torch.zeros((), dtype=torch.int64, device=rt.device)  # steps whose norm was over the limit
        self.steps_this_attempt = 0
        self.steps_peak_rss_mb = 0.0  # ru_maxrss when the last step ended (set by _finish)
        self.observer = StepObserver(cfg, rt, self.engine, self.say)  # --trace, --profile

    @property
    def net(self) -> torch.nn.Module:
        """The plain model (tensor-parallel layers in place, ZeRO's views of its shards)."""
        return self.engine.module

    @property
    def step(self) -> int:
        return self.run.step

    @property
    def history(self) -> list[dict]:
        return self.run.history

    def full_parameters(self) -> list[torch.Tensor]:
        """Copies of the unsharded model's parameters in registration order (collective)."""
        return self.engine.full_parameters()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train, evaluate, write ``metrics.jsonl``/``summary.json`` (rank 0); return the summary.

        A peer that dies or hangs makes the next collective fail within the group's timeout;
        that becomes a :class:`DistributedError` naming the step instead of a backend traceback.
        """
        try:
            return self._fit()
        except Exception as exc:
            if is_comm_failure(exc):
                raise comm_failure(exc, self.rt.rank, self.run.step + 1, self.run.last_snapshot or
                                   self.run.resumed_from, self.cfg.snapshot_dir) from exc
            raise
        finally:
            self.ahead.close()  # (the steps in flight finish: what the run writes read them)
            self.tb.close()
            self.run.end()  # the directories' locks

    def _fit(self) -> dict:
        cfg, run, engine = self.cfg, self.run, self.engine
        engine.observe()  # the state's bytes before the first step (the time budget's snapshot estimate)
        run.begin()
        done = finished_summary(cfg.out, run.run_id) if run.resumed_from is not None and \
            run.step >= self.total_steps else None
        if done is not None:  # resumed a run that had finished: say so, change nothing
            self.already_finished = True
            return done
        if run.resumed_from is not None:
            run.going_on()
        for line in header(self):
            self.say(line)
        self.log = MetricsLog(cfg.out if self.rt.is_main else None, run.history)
        self.tb = TensorBoardLog(cfg.tensorboard, self.rt.is_main, self.rt.device,
                                 purge_step=run.step + 1 if run.resumed_from is not None else None)
        language.write_tokenizer(cfg.out if self.rt.is_main else None, self.tokenizer)  # (rank 0 writes files)
        self.bar.update(run.step)
        times = StepTimes()
        engine.train()
        if run.resumed_from is not None and engine.needs_priming and run.step < self.total_steps:
            epoch, position = divmod(run.step, self.steps_per_epoch)  # torch's DDP: re-cut its buckets as the
            self.loader.set_epoch(epoch)                              # uninterrupted run did
            x, y, _ = split(next(self.loader.iter_from(position)))  # (the order gradients arrive in: a packed
            # batch's structure changes their values, not it; GRPO: the step's rollout, kept for it)
            x, y, _ = self.objective.batch(x.to(self.rt.device), y.to(self.rt.device), None, run.step + 1)
            engine.prime(x, self.objective.targets(y))
        start = time.perf_counter()
        # the handlers stay until the summary is written: a SIGTERM meanwhile (the agent passing a scheduler's on,
        # the scheduler repeating it) must not kill a rank in the middle of the snapshot the run stops with
        with Preemption() as preemption:
            stopped = self._loop(times, preemption)
            self.ahead.settle()  # (the last step's, before the final writes read it)
            preemption.settle()
            return self._finish(stopped, times, start)

    def _finish(self, stopped: str, times: StepTimes, start: float) -> dict:
        """After the loop: the last evaluation, snapshot and model file, the summary; returns the summary."""
        cfg, run = self.cfg, self.run
        self.steps_peak_rss_mb = peak_rss_mb()  # the steps' peak: before the final writes gather the whole model
        self.observer.finish()  # the run ended inside the traced or profiled steps: what was recorded
        self.bar.close()
        if stopped in ("time_budget", "completed") and (not run.evals or run.evals[-1]["step"] != run.step):
            result = self._evaluate(run.step // self.steps_per_epoch)  # (completed: a resumed run's stopped one)
            if stopped == "time_budget":
                self.say(f"time budget reached at step {run.step}: test accuracy "
                         f"{100 * result['test_accuracy']:.2f}%")
        stopped, unwritten = self._final_writes(stopped)  # a failed one: the summary still written, then said
        if stopped in ("preempted", "interrupted"):
            how = "preempted (SIGTERM)" if stopped == "preempted" else "interrupted (Ctrl-C)"
            self.say(f"{how} at step {run.step}: " + (
                f"snapshot {run.last_snapshot}; continue with --resume auto" if run.last_snapshot else
                "no --snapshot-dir, so the progress is lost"))
        summary = summarize(self, stopped, times, time.perf_counter() - start)
        if unwritten is not None:
            summary["final_write_error"] = f"{type(unwritten).__name__}: {first_line(unwritten)}"
        if self.rt.is_main and cfg.out:
            self.log.touch()  # a run that ended before its first log step still has a (empty) metrics.jsonl
            atomic_write_text(Path(cfg.out) / "config.toml", config_file_text(cfg))  # `distlab train --config` reruns it
            if self._predictions is not None:
                summary["predictions"] = write_predictions(Path(cfg.out), self.test_set, *self._predictions)
            write_summary(cfg.out, summary)
        if stopped == "final_write_failed":
            raise final_write_failed(unwritten, run, cfg.out, self.rt.is_main)
        if stopped == "non_finite":
            snap = f"; the last good state is in {run.last_snapshot}" if run.last_snapshot else ""
            if run.unwritten:
                snap += f" ({run.unwritten})"
            raise NonFiniteError(f"training diverged at {self._nonfinite}{snap}")
        return summary

    def _final_writes(self, stopped: str) -> tuple[str, BaseException | None]:
        """The last snapshot and a language model's final file (collective); returns why the run stopped
        (``final_write_failed`` where a write failed on any rank -- every rank learns that one did -- but for a
        diverged run, which says so itself) and what failed, None when all were written."""
        if self.diverged_on_device:
            self.run.settle()  # a background write in flight finishes: the last good state
            return stopped, None
        failed = None
        try:
            self.run.final_snapshot()
            if stopped != "non_finite":
                self.model_file = language.final_model(self)
        except Exception as exc:  # noqa: BLE001 - said after the summary is written
            if is_comm_failure(exc):
                raise
            failed = exc
        if reduce_scalars([float(failed is not None)], op=torch.distributed.ReduceOp.MAX)[0] and failed is None:
            failed = FinalWriteError("another rank's final write failed (rank 0 says which)")
        return ("final_write_failed" if failed is not None and stopped != "non_finite" else stopped), failed

    def _loop(self, times: StepTimes, preemption: Preemption) -> str:
        """Steps until the end, the time budget or a preemption; returns which stopped it.

        A step queues its work and waits for the device only where the loop must read it: a log line,
        an evaluation, a sample, a snapshot, the end (and every :data:`READ_EVERY` steps): there the
        gradients' verdict the device kept (:meth:`~distlab.parallel.Engine.skipped_steps`) and the
        steps' times (:class:`~distlab.train.clock.StepClock`) are read, once."""
        cfg, run, engine = self.cfg, self.run, self.engine
        clock = StepClock(self.rt.device)
        batches, first = None, True
        while run.step < self.total_steps:
            self.observer.before(run.step + 1)  # --trace, --profile: from their first step
            epoch, position = divmod(run.step, self.steps_per_epoch)
            if batches is None or position == 0:
                self.loader.set_epoch(epoch)
                batches = self.loader.iter_from(position)
            if run.out_of_time(times.step):
                return "non_finite" if self._diverged() else "time_budget"
            clock.start()
            with timeline.span("data"):
                x, y, fields = moved(next(batches), self.rt.device)
            x, y, fields = self.objective.batch(x, y, fields, run.step + 1)  # GRPO: the prompts' rollout
            lr = self.optimizer.param_groups[0]["lr"]
            sent = comm.bytes_sent()  # the step's bytes: the counter's growth (one read each side)
            self.optimizer.zero_grad(set_to_none=True)
            loss = engine.forward_backward(x, y, self.objective, self.objective.ignore_index, fields)
            if cfg.clip_grad_norm:
                self._grad_norm = engine.clip_grad_norm_(cfg.clip_grad_norm)
                self._clipped += self._grad_norm > cfg.clip_grad_norm  # on the device: read at the end
            try:
                engine.step(self.optimizer)
            except NonFiniteError as exc:  # nothing applied: the state is still that of the last step
                self._nonfinite = f"step {run.step + 1}: {exc}"
                return "non_finite"
            sent = comm.bytes_sent() - sent
            if first:  # gradients and optimizer state all exist now: the peak of plain DP
                self.ahead.settle()  # (what reads the model or the optimizer sees the whole step)
                engine.observe()
                anon_rss_mb()  # the anonymous memory's peak, read here and at every log line
                first = False
            self.scheduler.step()
            self._window_s += clock.stop(times, engine.sync_seconds, sent)
            self._window_timed += 1
            run.advance(loss)
            self.steps_this_attempt += 1
            self.bar.update(1)
            if self.hooks:
                self.ahead.settle()
            for hook in self.hooks:
                hook(run.step)
            last = run.step >= self.total_steps
            sample = bool(cfg.sample_every) and (run.step % cfg.sample_every == 0 or last)
            due_eval = last or (run.step % cfg.eval_every == 0 if cfg.eval_every else
                                cfg.eval_every_epoch and run.step % self.steps_per_epoch == 0)
            scheduled = run.step % cfg.log_every == 0 or sample or (due_eval and cfg.eval_every)
            due_log = scheduled or last
            due_snapshot = run.snapshot_due(self.total_steps)
            if due_eval or due_snapshot or sample or cfg.time_budget_s:  # (a log line reads the step's loss and
                self.ahead.settle()                                          # gradient norm, not the model)
            if due_log or due_eval or due_snapshot or cfg.time_budget_s or run.step % READ_EVERY == 0:
                if self._diverged():
                    return "non_finite"
                self._window_s += clock.flush(times)
            try:  # (a stop signal ends an evaluation between its batches: a scheduler's grace is short)
                evaluation = self._evaluate(epoch, say=False, stop=preemption.now) if due_eval else None
            except EvaluationStopped as stop:
                self.say(f"{stop.reason} during the evaluation of step {run.step}, which was left unfinished")
                return stop.reason
            # An evaluation joins its step's record; --eval-every's make their steps log steps.
            if due_log:
                self._log(epoch, lr, sample, evaluation, end_of_run=not scheduled)
            if evaluation is not None:  # after the step's own line
                self.say(eval_words(evaluation))
            if due_snapshot:
                run.save()
            self.observer.after(run.step)  # after their last step, its evaluation and snapshot included
            reason = preemption.poll()
            if reason:
                return "non_finite" if self._diverged() else reason
        return "completed"

    def clipped_steps(self) -> int | None:
        """How many of this attempt's steps had a gradient norm over ``clip_grad_norm`` (so were scaled down);
        None without clipping. Every rank counts the same global norms."""
        return int(self._clipped) if self.cfg.clip_grad_norm else None

    def _diverged(self) -> bool:
        """Whether the device skipped steps since the last read because a step's gradients were not finite
        (the engine's verdict, kept on the device: one read). If so the model is that of the step before
        the first bad one (every later update was skipped), which the run's step is set back to; the
        stop writes no snapshot (other state moved on: normalisation statistics, compression memory), so
        the newest one -- written after a read that found every step finite -- is the last good state."""
        skipped = self.engine.skipped_steps()
        if not skipped:
            return False
        first = self.run.step - skipped + 1
        later = f"; the {skipped - 1} step{'s' if skipped > 2 else ''} after it, queued before the verdict was " \
                f"read, {'were' if skipped > 2 else 'was'} skipped too" if skipped > 1 else ""
        self._nonfinite = f"step {first}: {self.engine.non_finite_message()}{later}"
        self.run.step = first - 1
        self.diverged_on_device = True
        return True

    # ------------------------------------------------------------------ logging and evaluation

    def _printer(self, show_bar: bool) -> Callable[[str], None]:
        if not (self.rt.is_main and self.cfg.verbose):
            return lambda s: None
        return self.bar.write if show_bar else (lambda s: print(s, flush=True))

    def _log(self, epoch: int, lr: float, sample: bool = False, evaluation: dict | None = None,
             end_of_run: bool = False) -> None:
        """One line of metrics.jsonl. ``end_of_run``: logged only because the run ends at this step (not a
        ``log_every`` step): marked so, its loss window kept open for a resume that goes on."""
        loss = self.run.close_window(keep=end_of_run)  # collective
        anon_rss_mb()
        # Throughput of the window's steps alone (timed in this attempt): evaluations, snapshots and a
        # restart in between are not training time.
        rate = self._window_timed * self.cfg.global_batch_size / self._window_s if self._window_s else None
        record = step_record(self, epoch, lr, loss, rate, sample, evaluation, end_of_run)
        self.run.history.append(record)
        self.log.write(record)
        self.tb.scalars("train", record, record["step"])
        self.tb.memory(record["step"])  # collective when on
        self.say(step_words(record, self.total_steps, self.throughput))
        self._window_s, self._window_timed = 0.0, 0
        if sample:
            self.say(f"sample   {record['sample']!r}")

    def _evaluate(self, epoch: int, say: bool = True, stop=None) -> dict:
        """The test (and validation) sets scored now; ``stop`` (:meth:`Preemption.now`) may end it between
        batches (:class:`~distlab.train.evaluate.EvaluationStopped`)."""
        t0 = time.perf_counter()
        evaluate_one = functools.partial(self.objective.evaluate, batch_size=self.eval_batch, stop=stop)
        with timeline.span("evaluation"), self.engine.gathered():  # ZeRO-3: one gather for the whole
            result = evaluate_one(self.eval_test, details=True)
            if "confusion" in result:  # a classifier: the newest evaluation's counts and mistakes, for the report
                self._predictions = (self.run.step, result.pop("confusion"), result.pop("misclassified"))
            if self.eval_val is not None:
                val = evaluate_one(self.eval_val)
                result.update({f"val_{k[len('test_'):]}": v for k, v in val.items() if k != "test_samples"})
        anon_rss_mb()  # evaluation's batches: the anonymous memory's peak may be here
        record = {"epoch": epoch, "step": self.run.step, "time_s": self.run.time_used(), **result}
        self.run.record_eval(record, time.perf_counter() - t0)
        self.tb.scalars("eval", result, self.run.step)
        if say:
            self.say(eval_words(record))
        return record
