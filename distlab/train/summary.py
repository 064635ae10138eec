"""What a run says about itself at its end: ``summary.json`` (the JSON contract in
docs/ARCHITECTURE.md) and its human-readable view -- beside :mod:`distlab.train.header`, what it says
before its first step. The settings both read (oversubscription, settings that do nothing) are here."""

from __future__ import annotations

import datetime
import math
import os
import platform
import socket
import statistics
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distlab.errors import DistlabError, FinalWriteError, first_line
from distlab.models import count_parameters
from distlab.parallel import components
from distlab.parallel.compile import compiled_graphs
from distlab.parallel.strategy import DEFAULT_DP_SYNC
from distlab.runtime import cores, load_before_run, reduce_scalars
from distlab.train.config_file import config_file_text
from distlab.train.metrics import anon_peak_mb, median_excluding_warmup, peak_rss_mb

SYNC_TIME_BASIS = ("seconds per step spent in the gradient sync after backward and in the post-step parameter "
                   "all-gather (ZeRO); sync that overlaps backward (bucketed, ddp) counts only where backward had "
                   "to wait for it")
MODEL_STATE_BASIS = "peak bytes of parameters + gradients + optimizer state held by one rank (max over ranks)"


@dataclass
class StepTimes:
    """Per optimizer step of this attempt: wall seconds, seconds in the gradient sync, bytes sent."""

    step: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)

    def add(self, step_s: float, sync_s: float, sent: int) -> None:
        self.step.append(step_s)
        self.sync.append(sync_s)
        self.sent.append(sent)


def plural(n: int, noun: str) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _text_facts(trainer, final: dict) -> dict:
    """For a language model: the unit of its losses, perplexity, and the baseline to beat."""
    data = trainer.train_set
    if getattr(data, "stops", None) is not None:  # prompts learned from rewards (GRPO)
        cfg = trainer.cfg
        return {"loss_unit": "grpo", "block_size": data.block_size, "test_reward": final.get("test_reward"),
                "group_size": cfg.group_size, "reward": cfg.reward or "exact", "grpo_loss": cfg.grpo_loss,
                "kl_beta": cfg.kl_beta, "eval_prompts": len(trainer.eval_test), "vocab_size": data.num_classes}
    if not hasattr(data, "unigram_entropy"):
        return {}
    loss = final.get("test_loss")
    if data.pairs:  # preference pairs: DPO's loss, a share of pairs preferred
        return {"loss_unit": "dpo", "block_size": data.block_size, "train_tokens": 2 * len(data) * data.block_size,
                "dpo_beta": trainer.objective.beta, "test_reward_margin": final.get("test_reward_margin"),
                "eval_pairs": len(trainer.eval_test), "vocab_size": data.num_classes}
    rate = trainer.test_set.tokens_per_byte  # tokens per byte of the test text: 1 for bytes
    tok = data.tokenizer
    return {"loss_unit": "nats/token", "block_size": data.block_size, "train_tokens": len(data) * data.block_size,
            "test_perplexity": math.exp(loss) if loss is not None else None,
            "test_tokens": final.get("test_tokens"),  # the targets the last evaluation scored (kept ones only)
            "eval_windows": len(trainer.eval_test),
            "unigram_entropy": None if data.ignores_targets else data.unigram_entropy,  # no baseline for masked
            # nats per byte of text: the loss that compares tokenizers (a token of BPE covers several bytes)
            "tokenizer": tok.spec if tok is not None else "bytes" if rate else "none", "vocab_size": data.num_classes,
            "test_tokens_per_byte": rate, "test_loss_per_byte": loss * rate if loss is not None and rate else None}


def expert_load(engine) -> dict | None:
    """A mixture of experts' routing over the run (collective): per MoE layer (whole-model name) the
    token-slots routed to each expert, summed over every rank that routed its own tokens (one per
    tensor-parallel group, or all of them under sequence parallel), the slots dropped by a capacity limit and the last balance loss; None
    for a model without experts."""
    layers = {engine.schedule.model_key(name): m for name, m in engine.module.named_modules()
              if name and callable(getattr(m, "routing_statistics", None))}
    own_tokens = engine.mesh.tp_rank == 0 or engine.strategy.sequence_parallel  # SP: each TP rank routes its own
    mine = {k: m.routing_statistics() for k, m in layers.items()} if own_tokens else {}
    parts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    merged: dict[str, dict] = {}
    for part in parts:
        for name, st in part.items():
            m = merged.setdefault(name, {"load": [0] * len(st["load"]), "routed": 0, "dropped": 0, "aux": []})
            m["load"] = [a + b for a, b in zip(m["load"], st["load"])]
            m["routed"] += st["routed"]
            m["dropped"] += st["dropped"]
            if st["aux_loss"] is not None:
                m["aux"].append(st["aux_loss"])
    if not merged:
        return None
    out = {}
    for name in sorted(merged, key=lambda k: [int(p) if p.isdigit() else p for p in k.split(".")]):
        m = merged[name]
        mean = sum(m["load"]) / len(m["load"])
        out[name] = {"load": m["load"], "max_over_mean": max(m["load"]) / mean if mean else None,
                     "routed": m["routed"], "dropped": m["dropped"],
                     "aux_loss": sum(m["aux"]) / len(m["aux"]) if m["aux"] else None}
    total = [sum(col) for col in zip(*(v["load"] for v in out.values()))]
    routed, dropped = sum(v["routed"] for v in out.values()), sum(v["dropped"] for v in out.values())
    return {"layers": out, "load": total, "max_over_mean": max(total) * len(total) / sum(total) if sum(total) else None,
            "routed": routed, "dropped": dropped, "dropped_fraction": dropped / routed if routed else 0.0,
            "basis": "token-slots (tokens x top_k) routed to each expert by the training forwards of this run, all "
                     "ranks; dropped: slots over an expert's capacity; aux_loss: the last step's balance loss "
                     "(mean over ranks)"}


def component_reports(engine) -> dict:
    """``{"components": {name: report}}`` of the model-sharding parallelisms that report anything (their
    kind's ``report(engine)``); empty where none does."""
    reported = {kind.name: r for kind in components.wanted(engine.strategy) if (r := kind.report(engine))}
    return {"components": reported} if reported else {}


def _overlapped(offload: dict) -> str:
    o = offload.get("overlap")
    return f"; its steps beside the forwards, which waited {o['forward_waited_s']:.2f} s for them" if o else ""


def summarize(trainer, stopped: str, times: StepTimes, wall_s: float) -> dict:
    """Every rank calls it (it reduces peaks over ranks); the result is the same everywhere."""
    cfg, rt, run, engine = trainer.cfg, trainer.rt, trainer.run, trainer.engine
    anon = anon_peak_mb()
    store = trainer.offload  # --offload: what its store holds (parallel.offload)
    ahead = trainer.ahead  # --offload-overlap: how long the main thread waited for the steps it overlapped
    rss, state_bytes, anon, offloaded, steps_rss, waited, forward_waited = reduce_scalars(
        [peak_rss_mb(), engine.peak_bytes, -1.0 if anon is None else anon, store.payload if store else 0,
         trainer.steps_peak_rss_mb, ahead.waited_s, ahead.forward_waited_s],
        op=dist.ReduceOp.MAX, device=rt.device)
    cuda_mb = None
    if rt.device.type == "cuda":
        cuda_mb, = reduce_scalars([torch.cuda.max_memory_allocated(rt.device) / 2**20], op=dist.ReduceOp.MAX,
                                  device=rt.device)
    median = median_excluding_warmup(times.step, cfg.timing_warmup_steps)
    uncounted = engine.uncounted_bytes_per_step()
    sent = (int(statistics.median(times.sent)) if times.sent else 0) + uncounted if rt.world_size > 1 else 0
    final = run.evals[-1] if run.evals else {"test_loss": None, "test_accuracy": None}
    strategy, mesh = cfg.strategy, engine.mesh
    module_params = count_parameters(engine.module)
    return {
        "world_size": rt.world_size,
        "strategy": strategy.to_dict(),
        "inactive": inactive_settings(strategy, trainer.mesh),  # settings that did nothing in this run, and why
        "cluster": emulated_cluster(),  # the emulated cluster's nodes and links the run crossed (None: none)
        "strategy_text": str(strategy),
        "compiled_graphs": compiled_graphs() if strategy.compile else None,  # this rank's, by torch.compile
        "strategy_label": strategy.label(trainer.rt.world_size),
        "mesh": {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp, "ep": mesh.ep,
                 **{d.name: d.size for d in mesh.dims.values()}, "layout": mesh.describe()},
        **engine.schedule.report(cfg.timing_warmup_steps, rt.device),  # a pipeline's stages and bubble
        "model": cfg.model,
        "dataset": cfg.dataset,
        "data_path": trainer.train_set.source or None,
        "data_on_device": trainer.data_resident,
        "host_allocator": trainer.host_allocator,
        "input_shape": list(trainer.train_set.input_shape),
        "num_classes": trainer.train_set.num_classes,
        "global_batch_size": cfg.global_batch_size,
        "local_batch_size": trainer.local_batch,
        "micro_batch_size": trainer.local_batch // strategy.micro_steps,
        "steps": run.step,
        "steps_per_epoch": trainer.steps_per_epoch,
        "epochs": round(run.step / trainer.steps_per_epoch, 4),
        "final_train_loss": run.last_loss,
        "train_loss_basis": (f"the training objective: cross-entropy against labels smoothed by {cfg.label_smoothing:g}"
                             f" (evaluations score the plain cross-entropy)" if cfg.label_smoothing else
                             "cross-entropy, mean over the logged steps' samples"),
        "clipped_steps": trainer.clipped_steps(),  # steps whose gradient norm was over clip_grad_norm (this attempt)
        "steps_this_attempt": trainer.steps_this_attempt,
        "test_accuracy": final["test_accuracy"],
        "test_loss": final["test_loss"],
        "eval_step": final.get("step"),  # the step of that last evaluation (--eval-every: maybe before the end)
        **_text_facts(trainer, final),
        "experts": expert_load(engine),
        **component_reports(engine),
        "best_val_loss": run.best_val_loss,
        "best_val_step": run.best_val_step,
        "val_samples": len(trainer.val_set) if trainer.val_set is not None else 0,
        "time_per_step_s_median": median,
        "timing_warmup_steps": min(cfg.timing_warmup_steps, len(times.step) // 2),
        "epoch_time_s": median * trainer.steps_per_epoch if median else None,
        "sync_time_s_median": median_excluding_warmup(times.sync, cfg.timing_warmup_steps),
        "sync_time_basis": SYNC_TIME_BASIS,
        "samples_per_s": cfg.global_batch_size / median if median else None,
        **trainer.throughput.summary(cfg.global_batch_size / median if median else None),  # tokens/s, MFU
        "peak_rss_mb": rss,
        "peak_rss_steps_mb": steps_rss,  # (ru_maxrss when the last step ended: the final evaluation and writes not yet)
        "peak_anon_rss_mb": anon if anon >= 0 else None,
        "memory_basis": ("peak_rss_mb: the most resident memory (ru_maxrss), file pages mapped included -- a "
                         "memory-mapped corpus's, which the kernel caches and can drop; peak_anon_rss_mb: the most "
                         "anonymous memory (RssAnon: what the process allocated itself) read after the first step, "
                         "at every log line and evaluation and at the end; both the largest of any rank"),
        "peak_cuda_mb": cuda_mb,
        "comm_bytes_per_step": sent,
        "comm_bytes_basis": ("counted by distlab.comm (messages of distlab's algorithms; torch's native "
                             "collectives at their textbook volume)" + (
                                 "; DDP's gradient all-reduce at the textbook 2(n-1)/n x gradient bytes"
                                 if uncounted else "")),
        "model_state_bytes_per_rank": int(state_bytes),
        "model_state_basis": MODEL_STATE_BASIS,
        **({"offload": {"mode": cfg.offload, "bytes_per_rank": int(offloaded), "where": str(store.directory)
                        if store.directory else "pinned host memory",
                        "basis": "bytes of the tensors held off the device (max over ranks); a file rounds each "
                                 "to whole pages",
                        **({"overlap": {"waited_s": waited, "forward_waited_s": forward_waited,
                                        "basis": "seconds the training thread waited for the optimizer steps run "
                                                 "beside it (max over ranks): in all, and in the forwards"}}
                           if cfg.offload_overlap else {})}} if store else {}),
        "wall_time_s": wall_s,
        "time_used_s": run.time_used(),
        "time_budget_s": cfg.time_budget_s,
        # the time budget's stop: the time used when it stopped, and what it kept for the end (the slowest of any
        # rank's, so time_budget_stop_s + time_budget_kept_s >= time_budget_s)
        "time_budget_stop_s": run.budget_stop[0] if run.budget_stop else None,
        "time_budget_kept_s": run.budget_stop[1] if run.budget_stop else None,
        "stopped": stopped,
        "resumed_from": run.resumed_from,
        "run_id": run.run_id,
        "fingerprint": run.fingerprint,
        "attempts": run.attempts,
        "layouts": run.layouts,
        "resharded_from": run.resharded_from,
        "restart_count": run.restart_count,
        "snapshot": run.last_snapshot,
        "model_file": trainer.model_file,  # a language model's run without snapshots: its final model
        # how long each snapshot of this attempt held the training up (--snapshot-async: the copy to host memory)
        "snapshot_stall_s_median": statistics.median(run.snapshot_stalls) if run.snapshot_stalls else None,
        "snapshot_async": cfg.snapshot_async,
        "trace": trainer.observer.trace_record,  # --trace: OUT/trace.json's steps, spans and clock residual
        "profile": trainer.observer.profile_record,  # --profile: OUT/profile/'s per-rank torch.profiler traces
        "evals": run.evals,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "lr_scaling": cfg.lr_scaling,
        "base_batch_size": cfg.base_batch_size,
        "lr_effective": cfg.effective_lr,
        "warmup_steps": cfg.warmup_steps,
        "lr_schedule": cfg.lr_schedule,
        "seed": cfg.seed,
        "num_parameters": trainer.num_parameters,
        "num_parameters_per_rank": module_params,
        "backend": rt.backend,
        "device": str(rt.device),
        "launcher": rt.launcher,
        "threads_per_rank": rt.threads,
        "cores": os.cpu_count(),
        "oversubscribed": oversubscription(rt) is not None,
        "load_before_run": load_before_run(),  # the machine's 1-minute load average before this run's own
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "config_toml": config_file_text(cfg),  # the same settings as OUT/config.toml: distlab train --config reruns it
    }


def oversubscription(rt) -> str | None:
    """A warning when this host's ranks run more threads than it has cores (then ranks wait for
    each other's cores and every time measured is the sharing's, not the method's); else None."""
    if rt.device.type != "cpu":
        return None
    have, want = cores(), rt.local_world_size * rt.threads
    if want <= have:
        return None
    fix = (f"--threads {max(1, have // rt.local_world_size)}" if rt.threads > 1 and rt.local_world_size <= have
           else f"at most {have} ranks per host")
    return (f"warning  {plural(rt.local_world_size, 'rank')} x {plural(rt.threads, 'thread')} on this host = {want} threads for "
            f"{have} cores: oversubscribed, so steps are slower than this machine allows and times measure the "
            f"sharing; use {fix} for timings that mean something")


def emulated_cluster() -> dict | None:
    """The emulated cluster this run was started on by ``distlab cluster run`` (its nodes and link)."""
    if not os.environ.get("DISTLAB_CLUSTER_NODES"):
        return None
    return {"nodes": int(os.environ["DISTLAB_CLUSTER_NODES"]), "link": os.environ.get("DISTLAB_CLUSTER_LINK"),
            "delay": os.environ.get("DISTLAB_CLUSTER_DELAY") or None, "burst": os.environ.get("DISTLAB_CLUSTER_BURST")}


def inactive_settings(strategy, mesh) -> list[str]:
    """Settings of this run that do nothing here, each with why (the header warns, the summary lists them)."""
    notes = []
    if mesh.replicas == 1:
        if strategy.zero:
            notes.append(f"zero {strategy.zero}: one data-parallel rank, so nothing is sharded (its flat shard copies "
                         f"only cost memory): drop --zero, or run more data-parallel ranks")
        if strategy.grad_compression != "none" or strategy.reduce_dtype:
            notes.append("gradient compression / reduce dtype: one data-parallel rank, no gradient is sent")
        if strategy.sync_bn != "off":
            notes.append(f"sync_bn {strategy.sync_bn}: one data-parallel rank, its BatchNorm statistics are already "
                         f"the whole batch's")
        if mesh.world_size > 1 and not strategy.zero and strategy.dp_sync != DEFAULT_DP_SYNC:  # a default is no setting
            notes.append(f"dp_sync {strategy.dp_sync}: one data-parallel rank, no gradient to synchronise (the mesh is "
                         f"{mesh.describe()})")
    return notes


def _fmt(value, spec: str = "", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def print_summary(summary: dict, out: str | None) -> None:
    """The human-readable view rank 0 prints at the end of a run."""
    s = summary
    per_rank = s.get("num_parameters_per_rank")
    params = f"{s['num_parameters']:,} params" + (f", {per_rank:,} per rank" if per_rank not in (None,
                                                                                              s["num_parameters"]) else "")
    rows = [
        ("model / dataset", f"{s['model']} ({params}) / {s['dataset']}"
                            + (f" from {s['data_path']}" if s.get("data_path") not in (None, "generated") else "")),
        ("world size", f"{s['world_size']} x {plural(s['threads_per_rank'], 'thread')}, {s['backend']} on {s['device']}"),
        ("strategy", s.get("strategy_label") or ("single process" if s["world_size"] == 1 else
                                                  s.get("strategy_text") or s["strategy"]["dp_sync"])),
        ("mesh", (s.get("mesh") or {}).get("layout", "n/a")),
        ("global batch", f"{s['global_batch_size']} ({s['local_batch_size']} per data-parallel rank"
                         + (f", micro-batches of {s['micro_batch_size']}"
                            if s.get("micro_batch_size", s["local_batch_size"]) != s["local_batch_size"] else "")
                         + ")"),
        ("steps / epochs", f"{s['steps']} / {s['epochs']:g}"),
        ("final train loss", _fmt(s["final_train_loss"], ".4f")
         + (f" (labels smoothed by {s['config']['label_smoothing']:g}: not comparable with the test loss)"
            if s.get("config", {}).get("label_smoothing") else "")),
        ("test accuracy", _fmt(None if s["test_accuracy"] is None else 100 * s["test_accuracy"], ".2f", "%")
                          + (" of pairs preferred (the chosen reward larger)" if s.get("loss_unit") == "dpo"
                             else " of next tokens" if s.get("loss_unit") else "")),
        ("test loss", _fmt(s["test_loss"], ".4f") + (f" (DPO, beta {s['dpo_beta']:g}; reward margin "
                                                       f"{s['test_reward_margin']:.4f})" if s.get("loss_unit") == "dpo"
                                                       and s.get("test_reward_margin") is not None else "")
                      + (f" nats/token, perplexity {s['test_perplexity']:.2f}"
                                                       if s.get("test_perplexity") else "")
                      + (f" (unigram entropy {s['unigram_entropy']:.3f})"
                         if s.get("test_perplexity") and s.get("unigram_entropy") is not None else "")
                      + (f"; {s['test_loss_per_byte']:.4f} nats/byte ({s['tokenizer']})"
                         if s.get("test_loss_per_byte") is not None and s.get("tokenizer") != "bytes" else "")),
        ("time/step (median)", _fmt(None if s["time_per_step_s_median"] is None
                                    else 1000 * s["time_per_step_s_median"], ".2f", " ms")),
        ("samples/s", _fmt(s["samples_per_s"], ",.0f")),
        ("comm bytes/step/rank", _fmt(s["comm_bytes_per_step"], ",")),
        ("model state/rank", _fmt(None if s.get("model_state_bytes_per_rank") is None
                                  else s["model_state_bytes_per_rank"] / 2**20, ".2f", " MiB (peak)")),
        *([("offloaded/rank", f"{s['offload']['bytes_per_rank'] / 2**20:.2f} MiB ({s['offload']['mode']}, in "
                              f"{s['offload']['where']})" + _overlapped(s['offload']))] if s.get("offload") else []),
        ("peak RSS per rank", _fmt(s["peak_rss_mb"], ".0f", " MB")
         + (f" ({s['peak_anon_rss_mb']:.0f} MB anonymous; the rest mapped files the kernel caches)"
            if s.get("peak_anon_rss_mb") is not None else "")),
        ("wall time", _fmt(s["wall_time_s"], ".1f", " s")),
    ]
    if s.get("clipped_steps") is not None:
        rows.insert(-1, ("clipping", f"clipped {s['clipped_steps']} of {s['steps_this_attempt']} steps to a global "
                                     f"norm of {s['config']['clip_grad_norm']:g}"))
    if s.get("compiled_graphs") is not None:
        rows.insert(-1, ("compiled", f"{s['compiled_graphs']} graphs by torch.compile (rank 0)" if s["compiled_graphs"]
                         else "nothing: torch.compile made no graph, every block ran eagerly"))
    experts = s.get("experts")
    if experts:
        rows.insert(8, ("expert load", f"{' '.join(str(v) for v in experts['load'])} token-slots per expert (all "
                                       f"layers), max/mean {experts['max_over_mean']:.2f}; dropped "
                                       f"{experts['dropped']:,} of {experts['routed']:,} "
                                       f"({100 * experts['dropped_fraction']:.2f}%)"))
    if s.get("best_val_loss") is not None:
        rows.insert(9, ("best val loss", f"{s['best_val_loss']:.4f} (step {s['best_val_step']})"))
    if s.get("lr_scaling", "none") != "none":
        rows.insert(6, ("effective lr", f"{s['lr_effective']:.4g} (--lr {s['lr']:g}, {s['lr_scaling']} scaling "
                                        f"from batch {s['base_batch_size']})"))
    if s.get("resumed_from"):
        rows.append(("resumed from", s["resumed_from"]))
    layouts = s.get("layouts") or []
    if len({(l["world_size"], l["strategy"]) for l in layouts}) > 1:
        rows.append(("layouts", " -> ".join(f"{l['world_size']} ranks {l['strategy'] or 'allreduce'} from step "
                                            f"{l['step']}" for l in layouts)))
    lost = [l["lost_steps"] for l in layouts if l.get("lost_steps") is not None]
    if lost:
        rows.append(("lost work", f"{sum(lost)} step(s) done again over {len(layouts) - 1} resume(s)"))
    if s.get("stopped") in ("preempted", "interrupted"):
        how = "preempted (SIGTERM)" if s["stopped"] == "preempted" else "interrupted (Ctrl-C)"
        rows.append(("stopped", f"{how} at step {s['steps']}"))
    if s.get("stopped") == "time_budget":
        kept = (f" (stopped at {s['time_budget_stop_s']:.1f} s, keeping {s['time_budget_kept_s']:.1f} s for the last "
                f"step, evaluation and snapshot)" if s.get("time_budget_stop_s") is not None else "")
        rows.append(("stopped", f"time budget {s['time_budget_s']:g} s reached after {s['time_used_s']:.1f} s{kept}"))
    if s.get("snapshot"):
        rows.append(("last snapshot", s["snapshot"]))
    if s.get("model_file"):
        rows.append(("final model", f"{s['model_file']} (distlab generate / export read the run directory)"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
    if out:
        print(f"summary: {out}/summary.json  metrics: {out}/metrics.jsonl", flush=True)


def final_write_failed(exc: BaseException, run, out: str | None, main: bool) -> FinalWriteError:
    """What a run that trained to its end says when its final snapshot or model file could not be written
    (after its summary was): what failed, what was written, and which snapshot holds its work. A failure
    that is distlab's own (not a :class:`~distlab.errors.DistlabError`) prints its traceback once, on rank 0."""
    if main and not isinstance(exc, DistlabError):
        traceback.print_exception(exc)
    wrote = f"; {out}/summary.json and metrics.jsonl were written" if out else ""
    kept = (f"its newest snapshot is {run.last_snapshot} (`distlab export` it, or go on with --resume auto)"
            if run.last_snapshot else "no snapshot holds its model (--snapshot-dir keeps them)")
    what = first_line(exc) if isinstance(exc, DistlabError) else f"{type(exc).__name__}: {first_line(exc)}"
    return FinalWriteError(f"the run trained to step {run.step}, but its final write failed: {what}{wrote}; {kept}")

