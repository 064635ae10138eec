"""The training loop, in one place: data, model, sync, optimizer, logging, evaluation, summary.

Every rank runs the same loop on its own slice of each global batch; only rank 0 writes files,
logs and draws the progress bar.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import signal
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from distlab import comm
from distlab.data import load_dataset
from distlab.data.loader import EvalLoader, TrainLoader
from distlab.errors import ConfigError, DistributedError
from distlab.models import build_model, count_parameters
from distlab.parallel import DataParallel, apply_tensor_parallel, build_mesh, convert_sync_batchnorm
from distlab.parallel.tensor_parallel import full_parameters
from distlab.parallel.zero import Zero, model_state_bytes
from distlab.runtime import Runtime, is_comm_failure, seed_everything
from distlab.train import snapshot
from distlab.train.config import TrainConfig
from distlab.train.metrics import MetricsLog, median_excluding_warmup, peak_rss_mb, write_summary
from distlab.train.snapshot import SnapshotError


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``--optimizer`` at the effective LR (``--lr`` scaled by ``--lr-scaling`` for the global batch)."""
    lr = cfg.effective_lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)


def lr_multiplier(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """LR at ``step`` relative to the effective LR: linear warm-up over ``--warmup-steps`` (from
    1/W to 1), times constant, cosine or linear decay to 0 over the run."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    progress = min(step / max(total_steps, 1), 1.0)
    if cfg.lr_schedule == "cosine":
        return warm * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.lr_schedule == "linear":
        return warm * (1.0 - progress)
    return warm


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))


def apply_sync_bn(net: torch.nn.Module, mode: str, device: torch.device) -> torch.nn.Module:
    """``--sync-bn``: off (each rank's own batch statistics), distlab, or torch's (GPU only)."""
    if mode == "distlab":
        return convert_sync_batchnorm(net)
    if mode == "torch":
        if device.type != "cuda":
            raise ConfigError(f"--sync-bn torch uses torch.nn.SyncBatchNorm, which only runs on GPUs (this run is on "
                              f"{device.type}); use --sync-bn distlab, which works on any device")
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
    return net


def _all_reduce(values: list[float], rt: Runtime, op=dist.ReduceOp.SUM, group=None) -> list[float]:
    """Reduce a few scalars across ranks (or ``group``) in one float64 collective."""
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    if rt.world_size > 1:
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, rt: Runtime, batch_size: int = 1000, mesh=None) -> dict:
    """Exact global loss and accuracy: disjoint shards, per-rank sums, one all-reduce.

    Shards cover the dataset exactly once whatever its size (no padding, no drop), so the
    result equals a single process evaluating the whole set, up to float64 summation order.
    With a tensor-parallel ``mesh`` the shards go to the data-parallel ranks (the ranks of a
    tensor-parallel group evaluate the same samples together) and the sums to the DP group.
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    rank, world = (mesh.dp_rank, mesh.dp) if mesh else (rt.rank, rt.world_size)
    for x, y in EvalLoader(dataset, rank=rank, world_size=world, batch_size=batch_size):
        x, y = x.to(rt.device), y.to(rt.device)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += int((out.argmax(1) == y).sum())
        count += len(y)
    model.train(was_training)
    loss_sum, correct, count = _all_reduce([loss_sum, correct, count], rt, group=mesh.dp_group if mesh else None)
    return {"test_loss": loss_sum / max(count, 1), "test_accuracy": correct / max(count, 1),
            "test_samples": int(count)}


class Trainer:
    """Builds data, model and optimizer for ``cfg`` on runtime ``rt``; ``fit()`` trains and summarises."""

    def __init__(self, cfg: TrainConfig, rt: Runtime):
        self.cfg = cfg.validate(rt.world_size)
        self.rt = rt
        self.train_set = load_dataset(cfg.dataset, "train", cfg.data_dir, seed=cfg.seed)
        self.test_set = load_dataset(cfg.dataset, "test", cfg.data_dir, seed=cfg.seed)
        self.val_set = None
        if cfg.val_fraction:  # a seeded, fixed split: the same on every rank and every restart
            n_val = max(1, round(cfg.val_fraction * len(self.train_set)))
            perm = torch.randperm(len(self.train_set), generator=torch.Generator().manual_seed(cfg.seed))
            self.val_set = self.train_set.subset(perm[:n_val].sort().values, "val")
            self.train_set = self.train_set.subset(perm[n_val:].sort().values, "train")
        # Tensor parallel: a 2-D mesh; data is split over the data-parallel ranks only.
        self.mesh = build_mesh(cfg.tp) if cfg.tp > 1 else None
        dp_rank, dp_size = (self.mesh.dp_rank, self.mesh.dp) if self.mesh else (rt.rank, rt.world_size)
        self.local_batch = cfg.global_batch_size // dp_size
        self.loader = TrainLoader(self.train_set, rank=dp_rank, world_size=dp_size,
                                  local_batch=self.local_batch, shuffle=True, seed=cfg.seed)
        if len(self.loader) == 0:
            raise ConfigError(f"--global-batch-size {cfg.global_batch_size} is larger than the "
                              f"{len(self.train_set)} training samples of {cfg.dataset}")
        # Seed right before building the model, then broadcast rank 0's weights (DataParallel).
        seed_everything(cfg.seed)
        net = build_model(cfg.model, self.train_set.input_shape, self.train_set.num_classes,
                          widths=cfg.mlp_widths).to(rt.device)
        if self.mesh:  # shards sliced from the full, seeded model: it computes what the unsharded one does
            net = apply_tensor_parallel(net, self.mesh.tp_group, cfg.tp_style)
        net = apply_sync_bn(net, cfg.sync_bn, rt.device)
        self.num_parameters = count_parameters(net)
        dp_group = self.mesh.dp_group if self.mesh else None
        if cfg.zero:  # ZeRO does the data-parallel gradient sync itself, over the DP group
            self.model = Zero(net, cfg.zero, group=dp_group, collective=cfg.collective)
            self.optimizer = build_optimizer(self.model.shard_parameters(), cfg)
            self.model.track(self.optimizer)
        else:
            self.model = DataParallel(net, cfg.dp_sync, group=dp_group, bucket_mb=cfg.bucket_mb,
                                      collective=cfg.collective, find_unused=cfg.find_unused)
            self.optimizer = build_optimizer(net.parameters(), cfg)
        self.micro_batch = self.local_batch // cfg.grad_accum
        self.steps_per_epoch = len(self.loader)
        total = cfg.epochs * self.steps_per_epoch
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)

    @property
    def net(self) -> torch.nn.Module:
        """The plain (unwrapped) model."""
        return self.model.module

    def full_parameters(self) -> list[torch.Tensor]:
        """Copies of the unsharded model's parameters in registration order, ZeRO and
        tensor-parallel shards gathered (collective: every rank calls it)."""
        with self._gathered():
            return full_parameters(self.net)

    def _gathered(self):
        """The full parameters in place (ZeRO-3 gathers them; otherwise they already are)."""
        return self.model.gathered() if isinstance(self.model, Zero) else contextlib.nullcontext()

    def _model_state_bytes(self) -> int:
        """Peak bytes of parameters + gradients + optimizer state on this rank."""
        if isinstance(self.model, Zero):
            return self.model.peak_bytes
        return model_state_bytes(self.net, self.optimizer)

    def _step_gradients(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward over ``grad_accum`` micro-batches, then one gradient sync.

        Every micro-batch but the last runs under ``no_sync()`` (no communication at all); each
        micro-batch loss is divided by K, so the accumulated gradient is the mean over the whole
        local batch -- the step equals one step on the K-times-larger batch. Returns this rank's
        mean loss over its samples and the seconds spent in the gradient sync.
        """
        k = self.cfg.grad_accum
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, (xm, ym) in enumerate(zip(x.split(self.micro_batch), y.split(self.micro_batch))):
            with self.model.no_sync() if i < k - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(self.model(xm), ym) / k
                loss.backward()
            total += loss.item()
        t0 = time.perf_counter()
        self.model.sync_gradients()
        return total, time.perf_counter() - t0

    def _ddp_native(self) -> bool:
        return self.cfg.dp_sync == "ddp" and self.cfg.collective == "native"

    def _bytes_per_step(self, counted: list[int]) -> int | None:
        """Median bytes sent per rank per step: distlab's counts, plus, for torch's DDP (which
        reduces inside autograd, out of sight), the textbook volume of all-reducing every gradient."""
        if self.rt.world_size == 1:
            return 0
        median = int(statistics.median(counted)) if counted else 0
        return median + (self.model.bytes_per_sync() or 0) if self._ddp_native() else median

    def _sync_device(self) -> None:
        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)

    # ------------------------------------------------------------------ snapshots

    def _layout(self) -> dict:
        """What a snapshot must agree on to be resumed by this run (compared field by field)."""
        cfg = self.cfg
        return {"world_size": self.rt.world_size, "model": cfg.model,
                "mlp_widths": list(cfg.mlp_widths) if cfg.model == "mlp" else None,
                "num_parameters": self.num_parameters, "dataset": cfg.dataset, "strategy": cfg.strategy(),
                "global_batch_size": cfg.global_batch_size, "optimizer": cfg.optimizer, "seed": cfg.seed,
                "val_fraction": cfg.val_fraction}

    @property
    def _sharded(self) -> bool:
        """Whether ranks hold different model states (ZeRO or tensor-parallel shards)."""
        return isinstance(self.model, Zero) or self.mesh is not None

    def _model_state(self) -> dict:
        """A copy of this rank's model state: its ZeRO shards, or the (tensor-parallel) module's."""
        if isinstance(self.model, Zero):
            return self.model.sharded_state_dict()
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def _load_model_state(self, state: dict, where: str) -> None:
        try:
            if isinstance(self.model, Zero):
                self.model.load_sharded_state_dict(state)
            else:
                self.net.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0]
            raise SnapshotError(f"snapshot {where} holds another model than this run's: {first[:300]}") from None

    def _save_snapshot(self) -> None:
        t0 = time.perf_counter()
        self._run_state["time_used_s"] = self._time_used()
        payload = {"model": self._model_state(), "optimizer": self.optimizer.state_dict(),
                   "scheduler": self.scheduler.state_dict(), "rng": snapshot.rng_state(), "step": self.step,
                   "window": [self._window_loss, self._window_steps], "run": self._run_state}
        if self._best_state is not None:
            payload["best_model"] = self._best_state
        path = snapshot.save(self.cfg.snapshot_dir, self.step, payload, self._layout(), self.cfg.keep_snapshots)
        self.last_snapshot = str(path)
        self._saved_step = self.step
        self._saved_any = True
        self._snapshot_s = time.perf_counter() - t0

    def _restore(self) -> str | None:
        """Load the snapshot ``--resume`` names (``auto``: the newest good one), if any; return its path.

        Without ``--resume``, a group that torchrun restarted after a failure (its
        ``TORCHELASTIC_RESTART_COUNT`` > 0) resumes ``auto`` from ``--snapshot-dir``.
        """
        cfg = self.cfg
        target = cfg.resume
        if target is None and cfg.snapshot_dir and self.restart_count > 0:
            target = "auto"
        if target is None:
            return None
        warn = (lambda m: print(m, file=sys.stderr, flush=True)) if self.rt.is_main else (lambda m: None)
        loaded = snapshot.resume(target, cfg.snapshot_dir, self._layout(), on_warning=warn)
        if loaded is None:
            warn(f"distlab: no snapshot in {cfg.snapshot_dir} yet: starting from step 0")
            return None
        p = loaded.payload
        self._load_model_state(p["model"], str(loaded.path))
        self.optimizer.load_state_dict(p["optimizer"])
        self.scheduler.load_state_dict(p["scheduler"])
        self.step = int(p["step"])
        self._window_loss, self._window_steps = float(p["window"][0]), int(p["window"][1])
        self._run_state = dict(p["run"])
        self.history = self._run_state["history"] = list(self._run_state["history"])
        self._best_state = p.get("best_model")
        self._saved_step = self.step
        snapshot.set_rng_state(p["rng"])  # last: nothing below draws random numbers before training
        if self.rt.is_main and cfg.verbose:
            print(f"resumed from {loaded.path} at step {self.step}", file=sys.stderr, flush=True)
        return str(loaded.path)

    # ------------------------------------------------------------------ time budget

    def _time_used(self) -> float:
        """Training time over every attempt: the snapshot's count plus this attempt's."""
        return self._time_before + (time.perf_counter() - self._start)

    def _out_of_time(self, step_times: list[float]) -> bool:
        """Would one more step, then the final evaluation and snapshot, overrun ``--time-budget``?

        Collective when a budget is set (one scalar all-reduce, MAX) so every rank stops at the same step.
        """
        budget = self.cfg.time_budget_s
        if budget is None:
            return False
        recent = statistics.median(step_times[-20:]) if step_times else 0.0
        if self._eval_s is None:  # no evaluation yet: forward passes ~1/3 of a training step per sample
            n_eval = len(self.test_set) + (len(self.val_set) if self.val_set is not None else 0)
            eval_s = recent * n_eval / self.cfg.global_batch_size / 3
        else:
            eval_s = self._eval_s
        # Before the first snapshot: its bytes at a slow disk's 100 MB/s.
        snapshot_s = self._snapshot_s if self._saved_any else self._state_bytes / 1e8
        margin = max(0.02 * budget, 0.2)  # summary, clocks of ranks that stop last
        need, = _all_reduce([self._time_used() + 2 * recent + eval_s + snapshot_s + margin], self.rt,
                            op=dist.ReduceOp.MAX)
        return need >= budget

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, epoch: int) -> dict:
        cfg, rt = self.cfg, self.rt
        t0 = time.perf_counter()
        with self._gathered():  # ZeRO-3: one gather for the whole evaluation
            result = evaluate(self.net, self.test_set, rt, cfg.eval_batch_size, self.mesh)
            if self.val_set is not None:
                val = evaluate(self.net, self.val_set, rt, cfg.eval_batch_size, self.mesh)
                result.update(val_loss=val["test_loss"], val_accuracy=val["test_accuracy"])
        record = {"epoch": epoch, "step": self.step, "time_s": self._time_used(), **result}
        state = self._run_state
        state["evals"].append(record)
        if "val_loss" in result and (state["best_val_loss"] is None or result["val_loss"] < state["best_val_loss"]):
            state["best_val_loss"], state["best_val_step"] = result["val_loss"], self.step
            if self._sharded or rt.is_main:  # every rank's shard, or rank 0's copy of the replicated model
                self._best_state = self._model_state()
        self._eval_s = time.perf_counter() - t0
        return record

    def _maybe_fault(self) -> None:
        """Test hook: ``DISTLAB_KILL_AT_STEP=RANK:STEP`` SIGKILLs that rank right after that step,
        on the first attempt only (a real, unannounced death for the fault-tolerance tests)."""
        spec = os.environ.get("DISTLAB_KILL_AT_STEP")
        if not spec or self.restart_count > 0:
            return
        rank, step = (int(v) for v in spec.split(":"))
        if rank == self.rt.rank and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train, evaluate, write ``metrics.jsonl``/``summary.json`` (rank 0); return the summary.

        A peer that dies or hangs makes the next collective fail within the group's timeout;
        that becomes a :class:`DistributedError` naming the step instead of a backend traceback.
        """
        self.step = 0
        self.history: list[dict] = []  # the logged records (every rank has them)
        try:
            return self._fit()
        except Exception as exc:
            if is_comm_failure(exc):
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise DistributedError(
                    f"rank {self.rt.rank}: communication failed at step {self.step + 1} ({first[:300]}); a peer "
                    f"died, hung or became unreachable -- check the other ranks' messages") from exc
            raise

    def _fit(self) -> dict:
        cfg, rt = self.cfg, self.rt
        main = rt.is_main
        self._run_state = {"history": self.history, "evals": [], "best_val_loss": None, "best_val_step": None,
                           "time_used_s": 0.0, "last_loss": float("nan"), "attempts": 0}
        self._best_state = None
        self._window_loss, self._window_steps = 0.0, 0
        self._saved_step = None
        self._eval_s, self._snapshot_s, self._saved_any = None, 0.0, False
        self._state_bytes = self._model_state_bytes() if self.cfg.snapshot_dir else 0
        self.last_snapshot = None
        resumed_from = self._restore()
        state = self._run_state
        state["attempts"] += 1
        self._time_before = state["time_used_s"]
        log = MetricsLog(cfg.out if main else None, self.history)
        show_bar = main and (cfg.progress if cfg.progress is not None else sys.stderr.isatty())
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not show_bar, unit="step",
                   dynamic_ncols=True, desc=f"{cfg.model} x{rt.world_size}")
        say = bar.write if show_bar else (lambda s: print(s, flush=True))
        if not cfg.verbose:
            say = lambda s: None  # noqa: E731

        step_times: list[float] = []
        sync_times: list[float] = []
        comm_bytes: list[int] = []
        window_t0 = time.perf_counter()
        self._start = time.perf_counter()
        step = first_step = self.step
        stopped = "completed"
        state_bytes = 0
        batches = None
        self.net.train()
        while step < self.total_steps:
            epoch, position = divmod(step, self.steps_per_epoch)
            if batches is None or position == 0:
                self.loader.set_epoch(epoch)
                batches = self.loader.iter_from(position)
            if self._out_of_time(step_times):
                stopped = "time_budget"
                break
            t0 = time.perf_counter()
            x, y = next(batches)
            x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
            lr = self.optimizer.param_groups[0]["lr"]
            with comm.counting() as sent:
                loss, sync_s = self._step_gradients(x, y)
                self.optimizer.step()
                t_step = time.perf_counter()
                self.model.after_step()  # ZeRO 1-2: all-gather the updated shards
                sync_s += time.perf_counter() - t_step
            comm_bytes.append(sent.bytes_sent)
            if step == first_step:  # gradients and optimizer state all exist now: the peak of plain DP
                state_bytes = self._model_state_bytes()
            self.scheduler.step()
            self._sync_device()
            step_times.append(time.perf_counter() - t0)
            sync_times.append(sync_s)
            step += 1
            self.step = step
            self._window_loss += loss
            self._window_steps += 1
            bar.update(1)
            self._maybe_fault()

            if step % cfg.log_every == 0 or step == self.total_steps:
                # Global mean loss over the window: local means averaged over ranks.
                total_loss, = _all_reduce([self._window_loss], rt)
                state["last_loss"] = total_loss / (self._window_steps * rt.world_size)
                now = time.perf_counter()
                record = {"step": step, "epoch": epoch, "loss": state["last_loss"], "lr": lr,
                          "samples_per_s": self._window_steps * cfg.global_batch_size / (now - window_t0),
                          "time_s": self._time_used()}
                self.history.append(record)
                if main:
                    log.write(record)
                    say(f"step {step:>6}/{self.total_steps} | epoch {epoch} | loss {state['last_loss']:.4f} | "
                        f"lr {record['lr']:.4g} | {record['samples_per_s']:,.0f} samples/s")
                self._window_loss, self._window_steps, window_t0 = 0.0, 0, time.perf_counter()
            epoch_done = step % self.steps_per_epoch == 0 or step >= self.total_steps
            if epoch_done and (cfg.eval_every_epoch or step >= self.total_steps):
                result = self._evaluate(epoch)
                if main:
                    val = (f" | val loss {result['val_loss']:.4f}" if "val_loss" in result else "")
                    say(f"eval epoch {epoch} | test loss {result['test_loss']:.4f} | test accuracy "
                        f"{100 * result['test_accuracy']:.2f}% ({result['test_samples']} samples){val}")
                window_t0 = time.perf_counter()  # evaluation time is not training throughput
            if cfg.snapshot_every and step % cfg.snapshot_every == 0 and step < self.total_steps:
                self._save_snapshot()
                window_t0 += self._snapshot_s
        bar.close()
        evals = state["evals"]
        if stopped == "time_budget" and (not evals or evals[-1]["step"] != step):
            result = self._evaluate(step // self.steps_per_epoch)
            if main:
                say(f"time budget reached at step {step}: test accuracy {100 * result['test_accuracy']:.2f}%")
        if cfg.snapshot_dir and self._saved_step != step:
            self._save_snapshot()
        wall = time.perf_counter() - self._start

        if isinstance(self.model, Zero):
            state_bytes = self.model.peak_bytes  # ZeRO-3's peak is during forward/backward of the largest layer
        rss, state_bytes = _all_reduce([peak_rss_mb(), state_bytes], rt, op=dist.ReduceOp.MAX)
        cuda_mb = None
        if rt.device.type == "cuda":
            cuda_mb, = _all_reduce([torch.cuda.max_memory_allocated(rt.device) / 2**20], rt, op=dist.ReduceOp.MAX)
        median = median_excluding_warmup(step_times, cfg.timing_warmup_steps)
        sync_median = median_excluding_warmup(sync_times, cfg.timing_warmup_steps)
        final = evals[-1] if evals else {"test_loss": None, "test_accuracy": None}
        summary = {
            "world_size": rt.world_size,
            "strategy": cfg.strategy(),
            "model": cfg.model,
            "dataset": cfg.dataset,
            "input_shape": list(self.train_set.input_shape),
            "num_classes": self.train_set.num_classes,
            "global_batch_size": cfg.global_batch_size,
            "local_batch_size": self.local_batch,
            "steps": step,
            "steps_per_epoch": self.steps_per_epoch,
            "epochs": round(step / self.steps_per_epoch, 4),
            "final_train_loss": state["last_loss"],
            "test_accuracy": final["test_accuracy"],
            "test_loss": final["test_loss"],
            "best_val_loss": state["best_val_loss"],
            "best_val_step": state["best_val_step"],
            "val_samples": len(self.val_set) if self.val_set is not None else 0,
            "time_per_step_s_median": median,
            "timing_warmup_steps": min(cfg.timing_warmup_steps, len(step_times) // 2),
            "epoch_time_s": median * self.steps_per_epoch if median else None,
            "sync_time_s_median": sync_median,
            "sync_time_basis": ("seconds per step spent in the gradient sync after backward and in the post-step "
                                "parameter all-gather (ZeRO); sync that overlaps backward (bucketed, ddp) counts "
                                "only where backward had to wait for it"),
            "samples_per_s": cfg.global_batch_size / median if median else None,
            "peak_rss_mb": rss,
            "peak_cuda_mb": cuda_mb,
            "comm_bytes_per_step": self._bytes_per_step(comm_bytes),
            "comm_bytes_basis": ("counted by distlab.comm (messages of distlab's algorithms; torch's native "
                                 "collectives at their textbook volume)" + (
                                     "; DDP's gradient all-reduce at the textbook 2(n-1)/n x gradient bytes"
                                     if self._ddp_native() else "")),
            "model_state_bytes_per_rank": int(state_bytes),
            "model_state_basis": "peak bytes of parameters + gradients + optimizer state held by one rank (max over ranks)",
            "wall_time_s": wall,
            "time_used_s": self._time_used(),
            "time_budget_s": cfg.time_budget_s,
            "stopped": stopped,
            "resumed_from": resumed_from,
            "attempts": state["attempts"],
            "restart_count": self.restart_count,
            "snapshot": self.last_snapshot,
            "evals": evals,
            "optimizer": cfg.optimizer,
            "lr": cfg.lr,
            "lr_scaling": cfg.lr_scaling,
            "base_batch_size": cfg.base_batch_size,
            "lr_effective": cfg.effective_lr,
            "warmup_steps": cfg.warmup_steps,
            "lr_schedule": cfg.lr_schedule,
            "seed": cfg.seed,
            "num_parameters": count_parameters(self.net),
            "backend": rt.backend,
            "device": str(rt.device),
            "launcher": rt.launcher,
            "threads_per_rank": rt.threads,
            "cores": os.cpu_count(),
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "hostname": socket.gethostname(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": cfg.to_dict(),
        }
        if main and cfg.out:
            write_summary(cfg.out, summary)
        return summary
