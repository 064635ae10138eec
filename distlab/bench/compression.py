"""``distlab bench compression``: gradient compression against uncompressed training, and distlab's
codecs beside torch's DDP hooks, on the same real training runs.

Every strategy trains the same job (by default the main job: MLP 784-512-256-10 on Fashion-MNIST,
global batch 64, SGD lr 0.05 momentum 0.9, cosine, one epoch) as a real ``distlab train`` -- on
this machine over loopback, or with ``--cluster`` one worker per emulated node with links shaped
to ``--bandwidth``. ``--runs R`` repeats the whole set R times, interleaved (round 1: every
strategy, round 2: every strategy, ...), so slow drift on a shared machine hits all of them alike.

Per strategy: median step time (the median over the rounds of each run's median), test accuracy,
bytes sent per step and rank, and two ratios, each the median over the rounds of that round's
ratio, with its range: ``speedup`` against the first strategy (uncompressed), and ``vs_torch``
against the strategy it is paired with in ``PAIRS`` (distlab's codec against torch's hook).
"""

from __future__ import annotations

import json
import statistics
import shutil
import sys
from pathlib import Path

from distlab.bench.common import check_train, cores, format_table, fresh_run_dir, machine, write
from distlab.bench.scaling import on_cluster, run_command
from distlab.launch.cluster import TBF_BURST
from distlab.errors import ConfigError
from distlab.tools.flags import strategy_flags
from distlab.parallel import Strategy

DEFAULT_STRATEGIES = ("bucketed", "bucketed+compress=powersgd:4", "ddp+compress=powersgd:4",
                      "bucketed+compress=fp16", "ddp+compress=fp16")
MAIN_JOB = ["--model", "mlp", "--dataset", "fashion-mnist", "--global-batch-size", "64", "--optimizer", "sgd",
            "--lr", "0.05", "--momentum", "0.9", "--lr-schedule", "cosine", "--seed", "0"]


def torch_counterpart(text: str) -> str | None:
    """The ddp strategy whose torch hook does what distlab's ``text`` does (bucketed+compress=X -> ddp+compress=X)."""
    s = Strategy.parse(text)
    if s.dp_sync != "bucketed" or s.grad_compression == "none":
        return None
    return str(Strategy.parse(text).replace(dp_sync="ddp", collective="native"))


def run(strategies=DEFAULT_STRATEGIES, nodes: int = 2, epochs: int = 1, max_steps: int | None = None,
        cluster: bool = False, bandwidth: str = "100mbit", runs: int = 3, data_dir: str | None = None,
        out: str | Path = "runs/bench-compression", timeout: float = 3600, progress=print) -> list[dict]:
    """Train every strategy ``runs`` times (interleaved); return one record per strategy."""
    if runs < 1 or nodes < 2:
        raise ConfigError("--runs must be at least 1 and --nodes at least 2")
    parsed = [Strategy.parse(s) for s in strategies]
    for s in parsed:
        s.check(nodes)
        check_train(nodes, model="mlp", dataset="fashion-mnist", global_batch_size=64, data_dir=data_dir,
                    epochs=epochs, max_steps=max_steps, **s.to_dict())
    if cluster:
        from distlab.launch import cluster as cl
        cl.check_capable()
    root = Path(out).resolve()
    threads = max(1, cores() // nodes)
    per_run: dict[str, list[dict]] = {str(s): [] for s in parsed}
    for r in range(runs):
        for s in parsed:
            run_dir = fresh_run_dir(root / "runs" / f"{str(s).replace('+', '_').replace(':', '-')}-r{r}")
            args = [*MAIN_JOB, "--epochs", str(epochs), *strategy_flags(s), "--log-every", "100", "--no-progress",
                    "--device", "cpu", "--out", str(run_dir)]
            args += ["--max-steps", str(max_steps)] if max_steps else []
            args += ["--data-dir", data_dir] if data_dir else []
            progress(f"compression: round {r + 1}/{runs}: {s} ...")
            shutil.rmtree(run_dir, ignore_errors=True)  # a previous invocation's run: replaced
            distlab = [sys.executable, "-m", "distlab", "train"]
            if cluster:
                on_cluster(distlab + ["--nproc-per-node", "1", *args], nodes, bandwidth, timeout)
            else:
                run_command(distlab + ["--nproc-per-node", str(nodes), "--threads", str(threads), *args], timeout)
            per_run[str(s)].append({**json.loads((run_dir / "summary.json").read_text()), "run_dir": str(run_dir)})
    records = _records(per_run, [str(s) for s in parsed], runs)
    where = (f"emulated cluster, {nodes} nodes x 1 worker ({threads} core(s) each), links {bandwidth}" if cluster
             else f"one machine, {nodes} workers over loopback, {threads} thread(s) each")
    for rec in records:
        rec.update(machine(nodes, threads), where=where, bandwidth=bandwidth if cluster else None, runs=runs,
                   epochs=epochs, max_steps=max_steps, burst=TBF_BURST if cluster else None,
                   run_dir=rec["run_dirs"][0])  # one run per strategy for `plan validate`
    write(records, root, "compression")
    return records


def _ratio(runs: list[dict], base: list[dict]) -> tuple[float, float, float]:
    """Median and range over the rounds of base's step time / this one's (above 1: this one is faster)."""
    ratios = [b["time_per_step_s_median"] / r["time_per_step_s_median"] for r, b in zip(runs, base)]
    return statistics.median(ratios), min(ratios), max(ratios)


def _records(per_run: dict[str, list[dict]], names: list[str], runs: int) -> list[dict]:
    base = per_run[names[0]]
    out = []
    for name in names:
        rs = per_run[name]
        rec = {"strategy": name, "time_per_step_s_median": statistics.median(r["time_per_step_s_median"] for r in rs),
               "test_accuracy": statistics.median(r["test_accuracy"] for r in rs),
               "test_accuracies": [r["test_accuracy"] for r in rs],
               "comm_bytes_per_step": rs[0]["comm_bytes_per_step"], "steps": rs[0]["steps"],
               "run_dirs": [r["run_dir"] for r in rs]}
        rec["speedup"], rec["speedup_min"], rec["speedup_max"] = _ratio(rs, base)
        twin = torch_counterpart(name)
        if twin in per_run:
            rec["vs_torch_strategy"] = twin
            rec["vs_torch"], rec["vs_torch_min"], rec["vs_torch_max"] = _ratio(rs, per_run[twin])
        out.append(rec)
    return out


def table(records: list[dict], markdown: bool = False) -> str:
    headers = ["strategy", "test accuracy", "time/step", "bytes/step/rank", f"speedup vs {records[0]['strategy']}",
               "vs torch's hook"]
    rows = []
    for r in records:
        vs = (f"{r['vs_torch']:.2f}x ({r['vs_torch_min']:.2f}-{r['vs_torch_max']:.2f}) vs {r['vs_torch_strategy']}"
              if r.get("vs_torch") else "")
        rows.append([r["strategy"], f"{100 * r['test_accuracy']:.2f}%", f"{1000 * r['time_per_step_s_median']:.1f} ms",
                     f"{r['comm_bytes_per_step']:,}", f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-"
                     f"{r['speedup_max']:.2f})", vs])
    return format_table(headers, rows, markdown)


def plot(records: list[dict], directory) -> list[Path]:
    """Step time and accuracy per strategy (one PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["strategy"] for r in records]
    a.barh(names, [1000 * r["time_per_step_s_median"] for r in records])
    a.set_xlabel("time per step (ms, median)")
    b.barh(names, [100 * r["test_accuracy"] for r in records])
    b.set_xlabel("test accuracy (%)")
    b.set_xlim(min(100 * r["test_accuracy"] for r in records) - 2, 100)
    b.set_yticklabels([])
    fig.suptitle(records[0].get("where", ""))
    fig.tight_layout()
    path = directory / "compression.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
