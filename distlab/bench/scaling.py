"""``distlab bench scaling``: the same training on 1, 2, 4, ... workers, weak and strong scaling.

*Weak scaling* keeps the per-worker batch ``B`` fixed (global batch ``N*B``; LR scaled with
``--lr-scaling``, sqrt by default, from base batch ``B``), so an epoch takes ``1/N`` of the steps;
*strong scaling* keeps the global batch fixed (same LR, same steps; each worker gets ``G/N``).
Each run is a real ``distlab train --nproc-per-node N`` job (torchrun, gloo) with a validation split;
its ``summary.json`` and ``metrics.jsonl`` stay in ``OUT/runs/...``.

Per run: LR, global batch, steps per epoch, epoch time (median step time x steps per epoch,
evaluation excluded), scaling efficiency, best validation loss, test loss, top-1 accuracy, and
the communication share of a step. Scaling efficiency is throughput per worker relative to one
worker: ``samples_per_s(N) / (N * samples_per_s(1))`` -- for weak scaling that is
``epoch_time(1) / (N * epoch_time(N))``.

Communication share, two ways: ``sync_share`` = time blocked in the gradient sync after backward
(and ZeRO's parameter all-gather) / step time, measured in the step; it misses communication that
overlaps backward (``bucketed``, ``ddp``). ``overhead_share`` = ``1 - T(1) / T(N)`` for weak scaling
(the same per-worker work; everything extra is communication and contention), which catches all of it.

``--cluster`` runs every method on an emulated cluster (:mod:`distlab.launch.cluster`), one node per
worker, at each ``--bandwidths`` rate, so the gradient sync crosses shaped links. Each node is
pinned to ``cores // nodes`` cores, and the 1-worker baseline (run once per method, on this
machine) gets as many threads, so ``overhead_share`` compares equal compute. On one machine too every run's
ranks get the threads the largest world's ranks do (``cores // max(worlds)``, at least 1): a scaling
efficiency compares the same compute per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from distlab.bench.common import at_least, check_train, choose, cores, format_table, fresh_run_dir, machine, write
from distlab.launch import prefork
from distlab.launch.cluster import TBF_BURST
from distlab.errors import ConfigError, DistlabError
from distlab.tools.flags import strategy_flags
from distlab.parallel import Strategy
from distlab.train.config import LR_SCALINGS


def _train_args(mode: str, world: int, per_worker: int, global_batch: int, method: str, opts: dict,
                out: Path) -> list[str]:
    batch = per_worker * world if mode == "weak" else global_batch
    args = ["--model", opts["model"], "--dataset", opts["dataset"], "--global-batch-size", str(batch),
            "--optimizer", opts["optimizer"], "--lr", str(opts["lr"]), "--lr-schedule", "constant",
            "--val-fraction", str(opts["val_fraction"]), *strategy_flags(Strategy.parse(method)),
            "--log-every", str(opts["log_every"]), "--no-progress", "--device", "cpu", "--seed", str(opts["seed"]), "--out", str(out)]
    if opts.get("data_dir"):
        args += ["--data-dir", opts["data_dir"]]
    if opts.get("mlp_widths"):
        args += ["--mlp-widths", opts["mlp_widths"]]
    if mode == "weak" and opts["lr_scaling"] != "none":
        args += ["--lr-scaling", opts["lr_scaling"], "--base-batch-size", str(per_worker)]
    if opts.get("max_steps"):
        args += ["--max-steps", str(opts["max_steps"])]
    args += ["--epochs", str(opts["epochs"])]
    return args


def _record(out: Path, mode: str, method: str, bandwidth: str | None) -> dict:
    s = json.loads((out / "summary.json").read_text())
    losses = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    return {"mode": mode, "dp_sync": method, "bandwidth": bandwidth, "burst": TBF_BURST if bandwidth else None,
            "world_size": s["world_size"],
            "lr": s["lr_effective"], "global_batch_size": s["global_batch_size"],
            "local_batch_size": s["local_batch_size"], "steps_per_epoch": s["steps_per_epoch"], "steps": s["steps"],
            "epoch_time_s": s["epoch_time_s"], "time_per_step_s_median": s["time_per_step_s_median"],
            "samples_per_s": s["samples_per_s"], "sync_time_s_median": s["sync_time_s_median"],
            "sync_share": (s["sync_time_s_median"] / s["time_per_step_s_median"]
                           if s["time_per_step_s_median"] else None),
            "comm_bytes_per_step": s["comm_bytes_per_step"], "best_val_loss": s["best_val_loss"],
            "test_loss": s["test_loss"], "test_accuracy": s["test_accuracy"], "final_train_loss": s["final_train_loss"],
            "threads_per_rank": s["threads_per_rank"], "wall_time_s": s["wall_time_s"],
            "loss_curve": [(r["time_s"], r["loss"]) for r in losses], "run_dir": str(out)}


def _add_efficiency(records: list[dict]) -> None:
    """Scaling efficiency and overhead share against the 1-worker run of the same mode/method/link."""
    for r in records:
        base = next((b for b in records if b["world_size"] == 1 and b["mode"] == r["mode"]
                     and b["dp_sync"] == r["dp_sync"] and b["bandwidth"] == r["bandwidth"]), None)
        if base is None or not base["samples_per_s"] or not r["samples_per_s"]:
            r["scaling_efficiency"] = r["overhead_share"] = None
            continue
        r["scaling_efficiency"] = r["samples_per_s"] / (r["world_size"] * base["samples_per_s"])
        r["overhead_share"] = (max(0.0, 1 - base["time_per_step_s_median"] / r["time_per_step_s_median"])
                               if r["mode"] == "weak" else None)


def run_command(cmd: list[str], timeout: float) -> None:
    with prefork.shared():  # the launch forks its workers from this process's server
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise DistlabError(f"a scaling run failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")


def run(worlds=(1, 2, 4), modes=("weak", "strong"), methods=("ddp",), per_worker_batch: int = 32,
        global_batch: int = 128, model: str = "mlp", dataset: str = "fashion-mnist", data_dir: str | None = None,
        epochs: int = 1, max_steps: int | None = None, optimizer: str = "adam", lr: float = 1e-3,
        lr_scaling: str = "sqrt", val_fraction: float = 0.1, bandwidths=(None,), cluster: bool = False,
        out: str | Path = "runs/bench", timeout: float = 3600, progress=print, mlp_widths: str | None = None) -> list[dict]:
    """Run the grid; return the records (also written to ``OUT/scaling.json``)."""
    at_least(world=(min(worlds, default=0), 1))
    modes = choose("--modes", modes, ("weak", "strong"))
    lr_scaling = choose("--lr-scaling", [lr_scaling], LR_SCALINGS)[0]
    if not methods:
        raise ConfigError("--methods: give at least one strategy")
    for m in methods:
        Strategy.parse(m).check(max(worlds))
    if 1 not in worlds:
        worlds = [1, *worlds]  # efficiency is relative to one worker
    for w in worlds:
        if "strong" in modes and global_batch % w:
            raise ConfigError(f"strong scaling splits --global-batch {global_batch} over {w} workers: use a "
                              f"multiple of every world size (e.g. {global_batch * max(worlds)})")
    try:
        widths = tuple(int(v) for v in mlp_widths.split(",")) if mlp_widths else None
    except ValueError:
        raise ConfigError(f"--mlp-widths takes comma-separated integers, not {mlp_widths!r}") from None
    for mode in modes:
        for method in methods:
            for w in worlds:
                weak = mode == "weak"
                check_train(w, model=model, dataset=dataset, data_dir=data_dir, epochs=epochs, max_steps=max_steps,
                            optimizer=optimizer, lr=lr, val_fraction=val_fraction, mlp_widths=widths,
                            global_batch_size=per_worker_batch * w if weak else global_batch,
                            lr_scaling=lr_scaling if weak else "none", base_batch_size=per_worker_batch if weak else None,
                            **Strategy.parse(method).to_dict())
    if cluster:
        from distlab.launch import cluster as cl
        cl.check_capable()
        for bandwidth in bandwidths:
            cl.validate_rate("--bandwidths", bandwidth)
    opts = {"model": model, "dataset": dataset, "data_dir": data_dir, "epochs": epochs, "max_steps": max_steps,
            "optimizer": optimizer, "lr": lr, "lr_scaling": lr_scaling, "val_fraction": val_fraction, "seed": 0,
            "log_every": 10, "mlp_widths": mlp_widths}
    root = Path(out)
    records = []
    baselines: dict = {}  # on the cluster, one 1-worker run per mode and method serves every link
    distlab = [sys.executable, "-m", "distlab", "train"]
    for bandwidth in bandwidths:
        for mode in modes:
            for method in methods:
                for world in worlds:
                    if cluster and world == 1 and (mode, method) in baselines:
                        records.append({**baselines[mode, method], "bandwidth": bandwidth})
                        continue
                    tag = f"{mode}-{method}-w{world}" + (f"-{bandwidth}" if bandwidth and world > 1 else "")
                    run_dir = fresh_run_dir((root / "runs" / tag).resolve())
                    args = _train_args(mode, world, per_worker_batch, global_batch, method, opts, run_dir)
                    progress(f"scaling: {tag} ...")
                    if cluster and world > 1:
                        on_cluster(distlab + ["--nproc-per-node", "1", *args], world, bandwidth, timeout)
                    else:
                        # Every run's ranks get the threads the largest world's do (cores // its workers; on the
                        # cluster each node's): efficiency compares equal compute per rank -- a 1-worker baseline
                        # with 2 threads against workers with 1 each made weak-scaling efficiencies of 7.7
                        threads = max(1, cores() // max(worlds))
                        run_command(distlab + ["--nproc-per-node", str(world), "--threads", str(threads), *args], timeout)
                    rec = _record(run_dir, mode, method, bandwidth if cluster else None)
                    rec.update(machine(world, rec["threads_per_rank"]))
                    rec["where"] = (f"emulated cluster, {world} nodes x 1 worker, links {bandwidth}"
                                    if cluster and world > 1 else f"one machine, {world} workers over loopback"
                                    f", {rec['threads_per_rank']} threads each")
                    records.append(rec)
                    if cluster and world == 1:
                        baselines[mode, method] = rec
    _add_efficiency(records)
    write(records, root, "scaling")
    return records


def on_cluster(cmd: list[str], nodes: int, bandwidth: str | None, timeout: float) -> None:
    """One worker per emulated node, each pinned to its share of the cores, links at ``bandwidth``."""
    from distlab.launch import cluster as cl
    from distlab.launch import cluster_jobs as cl_jobs
    name = f"sc{os.getpid() % 10000}"
    with cl.private(nodes, bandwidth, max(1, cores() // nodes), name), open(os.devnull, "w") as sink:
        code = cl_jobs.run(cmd, name, timeout, out=sink)
    if code:
        raise DistlabError(f"a scaling run on the emulated cluster failed (exit {code}): {' '.join(cmd)}")


def _fmt(v, spec):
    width = int(spec.split(".")[0] or 0)
    return f"{'-':>{width}}" if v is None else format(v, spec)


def table(records: list[dict], markdown: bool = False) -> str:
    """The weak/strong scaling table, one row per run (plus where, method and communication share).
    "epoch s" is the median step time x steps per epoch: with ``--max-steps`` an estimate, not a
    measured epoch (marked ``*``)."""
    rows = []
    for r in records:
        est = "*" if r.get("steps") is not None and r["steps"] < r["steps_per_epoch"] else ""
        rows.append([r["mode"], r["dp_sync"], r["bandwidth"] or "lo", str(r["world_size"]), f"{r['lr']:.3g}",
                     str(r["global_batch_size"]), str(r["steps_per_epoch"]), _fmt(r["epoch_time_s"], ".2f") + est,
                     _fmt(r["scaling_efficiency"], ".2f"), _fmt(r["sync_share"], ".0%"),
                     _fmt(r["overhead_share"], ".0%"), _fmt(r["best_val_loss"], ".4f"), _fmt(r["test_loss"], ".4f"),
                     _fmt(None if r["test_accuracy"] is None else 100 * r["test_accuracy"], ".2f") + "%"])
    out = format_table(["mode", "method", "link", "N", "LR", "batch", "steps/ep", "epoch s", "eff", "sync", "ovh",
                        "best val", "test loss", "top-1"], rows, markdown)
    if any(row[7].endswith("*") for row in rows):
        out += "\n* fewer steps than an epoch ran (--max-steps): epoch time extrapolated from the median step"
    return out


def plot(records: list[dict], directory: str | Path) -> list[Path]:
    """Loss vs wall time per run, and efficiency vs world size (per mode, method and link)."""
    from distlab.tools.plots import integer_ticks, pyplot, style
    plt = pyplot()

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    groups = sorted({(r["mode"], r["dp_sync"], r["bandwidth"] or "lo") for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, method, link in groups:
        for r in [r for r in records if (r["mode"], r["dp_sync"], r["bandwidth"] or "lo") == (mode, method, link)]:
            if r["loss_curve"]:
                t, loss = zip(*r["loss_curve"])
                ax = axes[0 if mode == "weak" else 1]
                ax.plot(t, loss, label=f"{method} {link} N={r['world_size']}", **style(len(ax.lines), len(t)))
    for ax, mode in zip(axes, ("weak", "strong")):
        ax.set_title(f"{mode} scaling: training loss vs time")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("loss")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(directory / "scaling-loss-vs-time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for mode, method, link in groups:
        rs = sorted((r for r in records if (r["mode"], r["dp_sync"], r["bandwidth"] or "lo") == (mode, method, link)
                     and r["scaling_efficiency"] is not None), key=lambda r: r["world_size"])
        if rs:
            ax.plot([r["world_size"] for r in rs], [r["scaling_efficiency"] for r in rs],
                    label=f"{mode} {method} {link}", **style(len(ax.lines)))
    integer_ticks(ax, [r["world_size"] for r in records])
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0, max([1.1, *(1.1 * r["scaling_efficiency"] for r in records if r["scaling_efficiency"])]))
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(directory / "scaling-efficiency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths

