"""``distlab bench dp``: every gradient-sync method (and collective) against torch's DDP, on real training.

Workloads (``--workloads``):

``mlp``              the MLP on Fashion-MNIST (real data; the main job's model)
``vgg11``            VGG-11 on CIFAR-10 (the real pickles if found, else CIFAR-shaped synthetic data)
``resnet18-syncbn``  ResNet-18 with distlab's SyncBatchNorm on CIFAR-100 (likewise)

For each workload: one process (the baseline) and every method on ``--nproc`` processes, each a
fresh set of processes running :class:`~distlab.train.Trainer` for ``--steps`` optimizer steps
and a final evaluation. Per run: median time per step (first steps excluded), samples/s, peak RSS
per rank, bytes sent per rank per step (distlab's accounting; unknown inside torch's DDP), final
training loss and test accuracy. With ``--runs R`` each configuration runs R times and the
median of the runs' medians is reported. Every rank uses ``cores // nproc`` torch threads (the
single-process baseline uses all cores). ``--cluster`` runs every multi-process configuration as
``distlab train`` with one worker per emulated node (:mod:`distlab.launch.cluster`, links at
``--bandwidth``, each node pinned to ``cores // nproc`` cores; the baseline gets as many threads).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from distlab.bench.common import at_least, choose, cores, machine, train_on_ranks, write
from distlab.errors import DataNotFoundError
from distlab.parallel import Strategy
from distlab.launch.spawn import run_ranks
from distlab.train.config import TrainConfig

WORKLOADS = {
    "mlp": {"model": "mlp", "dataset": "fashion-mnist", "fallback": None, "sync_bn": "off", "lr": 0.05},
    "vgg11": {"model": "vgg11", "dataset": "cifar10", "fallback": "synthetic:3x32x32:10:8192", "sync_bn": "off",
              "lr": 0.02},
    "resnet18-syncbn": {"model": "resnet18", "dataset": "cifar100", "fallback": "synthetic:3x32x32:100:8192",
                        "sync_bn": "distlab", "lr": 0.05},
}
METHODS = tuple(Strategy.parse(m) for m in ("gather-scatter", "allreduce", "allreduce:ring", "bucketed",
                                             "bucketed:ring", "ddp"))


def _dataset(workload: dict, data_dir: str | None) -> tuple[str, bool]:
    """The workload's dataset if it is on disk, else its synthetic stand-in (real: False)."""
    from distlab.data import locate
    if workload["dataset"].startswith("synthetic"):
        return workload["dataset"], False
    try:
        locate(workload["dataset"], data_dir)
        return workload["dataset"], True
    except DataNotFoundError:
        if workload["fallback"] is None:
            raise
        return workload["fallback"], False


def with_buckets(methods: list[Strategy], bucket_mbs: list[float] | None) -> list[Strategy]:
    """Each bucketed or ddp method once per bucket size (in that order); other methods once."""
    if not bucket_mbs:
        return list(methods)
    out = []
    for m in methods:
        out += [m.replace(bucket_mb=b) for b in bucket_mbs] if m.dp_sync in ("bucketed", "ddp") else [m]
    return out


def _train_on_cluster(cfg: TrainConfig, nodes: int, bandwidth: str) -> dict:
    """One run as ``distlab train`` with one worker per emulated node (links at ``bandwidth``); its
    summary. The run's directory is temporary and removed."""
    from distlab.bench.scaling import on_cluster
    from distlab.tools.flags import strategy_flags
    with tempfile.TemporaryDirectory(prefix="distlab-bench-dp-") as workdir:
        out = Path(workdir) / "run"
        args = ["--model", cfg.model, "--dataset", cfg.dataset, "--global-batch-size", str(cfg.global_batch_size),
                "--lr", str(cfg.lr), "--lr-schedule", cfg.lr_schedule, "--seed", str(cfg.seed), "--epochs", "1000",
                "--max-steps", str(cfg.max_steps), "--log-every", str(cfg.log_every), "--no-progress",
                "--device", "cpu", *strategy_flags(cfg.strategy), "--out", str(out)]
        args += ["--data-dir", cfg.data_dir] if cfg.data_dir else []
        on_cluster([sys.executable, "-m", "distlab", "train", "--nproc-per-node", "1", *args], nodes, bandwidth,
                    3600)
        return json.loads((out / "summary.json").read_text())


def run(workloads=("mlp", "vgg11", "resnet18-syncbn"), nproc: int = 2, steps: int = 30, batch: int = 64,
        methods=METHODS, runs: int = 1, data_dir: str | None = None, out=None, progress=print,
        bucket_mbs: list[float] | None = None, cluster: bool = False, bandwidth: str = "1gbit",
        trace: bool = False) -> list[dict]:
    """Every method (each bucket size of ``bucket_mbs`` for bucketed and ddp) on every workload, and
    one process for reference; with ``cluster``, every multi-process run has one worker per emulated
    node, its links shaped to ``bandwidth``. ``trace``: each multi-process configuration's first run
    traces its last two steps (OUT/traces/WORKLOAD-METHOD/trace.json) and its record says how much of
    the communication hid behind the backward and how much was left exposed."""
    workloads = choose("--workloads", workloads, WORKLOADS)
    at_least(nproc=(nproc, 2), steps=(steps, 3), runs=(runs, 1))
    methods = with_buckets(methods, bucket_mbs)
    for m in methods:
        m.check(nproc).check_batch(batch, nproc)
    if trace and (cluster or out is None):
        from distlab.errors import ConfigError
        raise ConfigError("--trace writes each method's timeline under --out, on this machine: drop --cluster"
                          if cluster else "--trace writes each method's timeline under --out: give --out")
    if cluster:
        from distlab.launch import cluster as cl
        cl.check_capable()
    records = []
    for name in workloads:
        w = WORKLOADS[name]
        dataset, real = _dataset(w, data_dir)
        plan = [(1, Strategy("allreduce"))] + [(nproc, m) for m in methods]
        for world, strategy in plan:
            if world > 1 and w["sync_bn"] != "off":
                strategy = strategy.replace(sync_bn=w["sync_bn"])
            label = "single process" if world == 1 else str(strategy)
            threads = max(1, cores() // (nproc if cluster else world))  # a node gets cores // nodes
            summaries = []
            for i in range(runs):
                progress(f"{name} ({dataset}): {label} on {world} process(es)" + (f", run {i + 1}" if runs > 1 else ""))
                cfg = TrainConfig(model=w["model"], dataset=dataset, data_dir=data_dir, epochs=1000, max_steps=steps,
                                  global_batch_size=batch, lr=w["lr"], lr_schedule="constant", seed=0,
                                  log_every=max(1, steps), progress=False, verbose=False, eval_every_epoch=False,
                                  strategy=strategy, timing_warmup_steps=min(5, steps // 3))
                if trace and world > 1 and i == 0:
                    slug = str(strategy).replace(":", "-").replace("+", "-").replace("=", "")
                    cfg = dataclasses.replace(cfg, out=str(Path(out) / "traces" / f"{name}-{slug}"),
                                              trace=f"{max(1, steps - 1)}:{steps}")
                if cluster and world > 1:
                    summaries.append(_train_on_cluster(cfg.validate(world), world, bandwidth))
                else:
                    summaries.append(run_ranks(train_on_ranks, world, cfg, timeout=3600, threads=threads)[0])
            s = summaries[0]
            med = statistics.median(x["time_per_step_s_median"] for x in summaries)
            records.append({
                "workload": name, "model": w["model"], "dataset": dataset, "real_data": real, "world_size": world,
                "dp_sync": strategy.dp_sync if world > 1 else None,
                "collective": strategy.collective if world > 1 else None,
                "strategy_text": str(strategy) if world > 1 else None,
                "bucket_mb": strategy.bucket_mb if world > 1 and strategy.dp_sync in ("bucketed", "ddp") else None,
                "sync_bn": s["strategy"]["sync_bn"], "global_batch_size": batch, "steps": steps, "runs": runs,
                "time_per_step_s_median": med, "time_per_step_s_per_run": [x["time_per_step_s_median"] for x in summaries],
                "samples_per_s_median": batch / med, "peak_rss_mb": max(x["peak_rss_mb"] for x in summaries),
                "comm_bytes_per_step": s["comm_bytes_per_step"], "final_train_loss": s["final_train_loss"],
                "test_accuracy": s["test_accuracy"], "test_loss": s["test_loss"],
                "num_parameters": s["num_parameters"], **machine(world, threads),
                "where": (f"emulated cluster, {world} nodes x 1 worker, links {bandwidth}" if cluster and world > 1
                          else f"one machine, {world} process(es) x {threads} thread(s)"),
                "bandwidth": bandwidth if cluster and world > 1 else None,
                **({"hidden_communication": s["trace"]["hidden_communication"],
                    "exposed_communication_s_per_step": s["trace"]["exposed_communication_s_per_step"],
                    "trace_path": s["trace"]["path"]} if s.get("trace") else {}),
            })
    write(records, out, "dp")
    return records


def rows(records: list[dict]) -> list[dict]:
    """Display cells per record: method label, ratio to DDP's samples/s, MB per step, accuracy."""
    sizes = {r.get("bucket_mb") for r in records if r.get("bucket_mb") is not None}
    swept = len(sizes) > 1  # several bucket sizes: label them, and compare with DDP at the same size
    ddp = {(r["workload"], r.get("bucket_mb") if swept else None): r["samples_per_s_median"] for r in records
           if r["dp_sync"] == "ddp" and r["collective"] == "native"}
    out = []
    for r in records:
        bucket = r.get("bucket_mb") if swept else None
        key = (r["workload"], bucket if bucket is not None else (min(sizes, key=lambda b: abs(b - 25)) if swept else None))
        label = "1 process" if r["world_size"] == 1 else f"{r['dp_sync']}:{r['collective']}"
        out.append({
            "workload": r["workload"], "procs": r["world_size"],
            "method": label + (f" {bucket:g} MB" if bucket is not None else ""),
            "ms": f"{1000 * r['time_per_step_s_median']:.1f}", "sps": f"{r['samples_per_s_median']:.0f}",
            "vs_ddp": (f"{r['samples_per_s_median'] / ddp[key]:.2f}x"
                       if key in ddp and r["world_size"] > 1 else "-"),
            "mb": "?" if r["comm_bytes_per_step"] is None else f"{r['comm_bytes_per_step'] / 2**20:.1f}",
            "rss": f"{r['peak_rss_mb']:.0f}", "loss": f"{r['final_train_loss']:.3f}",
            "acc": "-" if r["test_accuracy"] is None else f"{100 * r['test_accuracy']:.1f}%",
            "hidden": "-" if r.get("hidden_communication") is None else f"{100 * r['hidden_communication']:.0f}%",
        })
    return out


def table(records: list[dict]) -> str:
    traced = any("hidden_communication" in r for r in records)  # --trace: the share of communication hidden
    lines = [f"{'workload':<16} {'procs':>5} {'method':<22} {'ms/step':>8} {'samples/s':>9} {'vs ddp':>7} "
             f"{'MB/step':>8} {'RSS MB':>7} {'loss':>6} {'test acc':>8}" + (f" {'hidden':>7}" if traced else "")]
    for c in rows(records):
        lines.append(f"{c['workload']:<16} {c['procs']:>5} {c['method']:<22} {c['ms']:>8} {c['sps']:>9} "
                     f"{c['vs_ddp']:>7} {c['mb']:>8} {c['rss']:>7} {c['loss']:>6} {c['acc']:>8}"
                     + (f" {c['hidden']:>7}" if traced else ""))
    return "\n".join(lines)


def plot(records: list[dict], directory) -> list:
    """One PNG per workload: samples/s per method (bars), DDP's level as a line."""
    from pathlib import Path

    from distlab.tools.plots import pyplot
    plt = pyplot()

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        cells = [c for c, r in zip(rows(records), records) if r["workload"] == workload]
        values = [float(c["sps"]) for c in cells]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(range(len(cells)), values, color=["#888" if c["procs"] == 1 else "#4477aa" for c in cells])
        ax.set_xticks(range(len(cells)), [c["method"] for c in cells], rotation=30, ha="right")
        ddp = [float(c["sps"]) for c in cells if c["method"] in ("ddp:native", "ddp:native 25 MB")]
        if ddp:
            ax.axhline(ddp[0], color="#cc3311", linestyle="--", label="torch DDP")
            ax.legend()
        ax.set_ylabel("samples/s")
        ax.set_title(f"data parallel: {workload}")
        fig.tight_layout()
        path = directory / f"dp_{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
