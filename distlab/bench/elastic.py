"""``distlab bench elastic``: lose a node mid-epoch on the emulated cluster and keep training.

Two runs of the main job (MLP on Fashion-MNIST, SGD + momentum, global batch 64), one worker per
emulated node, both launched elastically (``--nnodes 1:N``, c10d rendezvous on node 0, snapshots
every ``--snapshot-every`` steps):

* **uninterrupted** -- all ``N`` nodes to the end;
* **node lost** -- when rank 0 has logged step ``--kill-at-step``, ``distlab cluster kill-node N-1``
  SIGKILLs every process of the last node. The survivors' next collective fails (a peer closed
  its sockets), torchrun's agents restart their workers and re-rendezvous without the dead node,
  the workers resume the newest snapshot -- resharded to the smaller world, the global batch kept
  -- and finish. With ``--revive`` the node is started again once the survivors have trained on; the
  agents take it in at a re-rendezvous (a membership change) and the run finishes on ``N`` nodes.

Reported: test accuracy of both and their difference in points, the layouts over time (world
size per attempt and the step it began at), the steps done again (as far as rank 0 logged them,
every ``--log-every``: a lower bound within that), wall time of each run.

The node at the rendezvous endpoint (node 0) hosts torchrun's c10d store, so it must survive, as
with any c10d rendezvous (an etcd rendezvous has no such node).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from distlab.bench.common import format_table, machine, write
from distlab.bench.compression import MAIN_JOB
from distlab.errors import ConfigError, DistlabError
from distlab.runtime import cores

RDZV_PORT = 29400


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def _command(nodes: int, run_dir: Path, job: list[str], snapshot_every: int, log_every: int,
             restarts: int) -> list[str]:
    return [sys.executable, "-m", "distlab", "train", "--nnodes", f"1:{nodes}", "--nproc-per-node", "1",
            "--max-restarts", str(restarts), "--rdzv-endpoint", f"{{master_addr}}:{RDZV_PORT}",
            "--rdzv-conf", "last_call_timeout=3", "--comm-timeout", "60", "--device", "cpu", *job,
            "--snapshot-dir", str(run_dir / "snapshots"), "--snapshot-every", str(snapshot_every),
            "--log-every", str(log_every), "--no-progress", "--out", str(run_dir)]


def run(nodes: int = 2, epochs: int = 1, kill_at_step: int = 400, snapshot_every: int = 100, log_every: int = 10,
        revive: bool = False, bandwidth: str | None = "1gbit", data_dir: str | None = None,
        max_steps: int | None = None, job: list[str] | None = None, out: str | Path = "runs/bench-elastic",
        timeout: float = 3600, uninterrupted: bool = True, progress=print) -> list[dict]:
    """The uninterrupted run (unless ``uninterrupted`` is False) and the node-loss run; one record."""
    from distlab.launch import cluster as cl
    if nodes < 2:
        raise ConfigError("--nodes must be at least 2 (one is lost)")
    if not 0 < kill_at_step:
        raise ConfigError(f"--kill-at-step must be positive, not {kill_at_step}")
    cl.check_capable()
    root = Path(out).resolve()
    job = list(job or MAIN_JOB) + ["--epochs", str(epochs)]
    job += ["--max-steps", str(max_steps)] if max_steps else []
    job += ["--data-dir", data_dir] if data_dir else []
    name = f"el{os.getpid() % 10000}"
    restarts = 3
    results = {}
    with cl.private(nodes, bandwidth, max(1, cores() // nodes), name):
        for kind in ("uninterrupted", "node-lost")[0 if uninterrupted else 1:]:
            run_dir = root / kind
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            cmd = _command(nodes, run_dir, job, snapshot_every, log_every, restarts)
            progress(f"elastic: {kind} run on {nodes} nodes ...")
            results[kind] = _one(cl, name, cmd, run_dir, nodes, kind == "node-lost", kill_at_step, revive,
                                 log_every, timeout, progress)
            shutil.rmtree(run_dir / "snapshots", ignore_errors=True)  # the record keeps what they did
    straight, lost = results.get("uninterrupted"), results["node-lost"]
    s, summary = (straight or {}).get("summary", {}), lost["summary"]
    resumes = summary["layouts"][1:]
    record = {"nodes": nodes, "bandwidth": bandwidth, "epochs": epochs, "max_steps": max_steps,
              "snapshot_every": snapshot_every, "log_every": log_every, "killed_node": nodes - 1,
              "killed_at_step": lost["killed_at"], "revived_at_step": lost.get("revived_at"), "revive": revive,
              "steps": summary["steps"], "stopped": summary["stopped"],
              "test_accuracy_uninterrupted": s.get("test_accuracy"), "test_accuracy_node_lost": summary["test_accuracy"],
              "accuracy_diff_points": 100 * (summary["test_accuracy"] - s["test_accuracy"]) if s else None,
              "layouts": summary["layouts"], "attempts": summary["attempts"],
              "resumed_at_steps": [entry["step"] for entry in resumes],
              "lost_steps": [entry.get("lost_steps") for entry in resumes],
              "lost_steps_max_bound": snapshot_every,
              "wall_time_s_uninterrupted": straight["wall_s"] if straight else None,
              "wall_time_s_node_lost": lost["wall_s"],
              "time_per_step_s_median_uninterrupted": s.get("time_per_step_s_median"),
              "run_dirs": [str(root / "uninterrupted"), str(root / "node-lost")],
              "where": f"emulated cluster, {nodes} nodes x 1 worker, links {bandwidth or 'unshaped'}",
              **machine(nodes, max(1, cores() // nodes))}
    write([record], root, "elastic")
    return [record]


def _one(cl, name: str, cmd: list[str], run_dir: Path, nodes: int, kill: bool, kill_at_step: int, revive: bool,
         log_every: int, timeout: float, progress) -> dict:
    from distlab.launch import cluster_jobs as cl_jobs
    codes: dict[str, int] = {}
    t0 = time.perf_counter()
    with open(run_dir / "cluster.log", "w") as log:
        main = threading.Thread(target=lambda: codes.setdefault("run", cl_jobs.run(cmd, name, timeout, out=log)),
                                daemon=True)
        main.start()
        out: dict = {}
        if kill:
            while main.is_alive() and _last_step(run_dir) < kill_at_step:
                time.sleep(0.05)
            if not main.is_alive():
                raise DistlabError(f"the run ended before step {kill_at_step}: kill earlier (--kill-at-step)")
            out["killed_at"] = _last_step(run_dir)
            cl_jobs.kill_node(nodes - 1, name)
            progress(f"elastic: killed node {nodes - 1} at logged step {out['killed_at']}")
            if revive:  # once the survivors have trained past the kill, bring the node back
                target = out["killed_at"] + 2 * log_every
                while main.is_alive() and _last_step(run_dir) < target:
                    time.sleep(0.05)
                if main.is_alive():
                    out["revived_at"] = _last_step(run_dir)
                    back = threading.Thread(
                        target=lambda: codes.setdefault("revived", cl_jobs.revive_node(nodes - 1, name, timeout, out=log)),
                        daemon=True)
                    back.start()
                    progress(f"elastic: revived node {nodes - 1} at logged step {out['revived_at']}")
                    back.join(timeout)
        main.join(timeout)
    out["wall_s"] = time.perf_counter() - t0
    if main.is_alive() or codes.get("run") or codes.get("revived"):
        tail = (run_dir / "cluster.log").read_text()[-3000:]
        if codes.get("revived") and not codes.get("run") and "of another run" in tail:
            raise DistlabError("the job had finished before the revived node came up (it started a new job): "
                               "kill earlier (--kill-at-step) or train longer")
        raise DistlabError(f"an elastic run failed (exit {codes.get('run')}, revived node exit "
                           f"{codes.get('revived')}):\n{tail}")
    out["summary"] = json.loads((run_dir / "summary.json").read_text())
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def table(records: list[dict], markdown: bool = False) -> str:
    rows = []
    for r in records:
        layouts = " -> ".join(f"{e['world_size']}@{e['step']}" for e in r["layouts"])
        lost = ", ".join("?" if x is None else str(x) for x in r["lost_steps"]) or "-"
        rows.append([str(r["nodes"]), r["bandwidth"] or "-", str(r["killed_at_step"]), layouts, lost,
                     _pct(r["test_accuracy_uninterrupted"]), _pct(r["test_accuracy_node_lost"]),
                     "-" if r["accuracy_diff_points"] is None else f"{r['accuracy_diff_points']:+.2f}",
                     f"{r['wall_time_s_uninterrupted'] or 0:.0f} / {r['wall_time_s_node_lost']:.0f} s"])
    return format_table(["nodes", "link", "killed at", "world@step", "steps redone", "acc. uninterrupted",
                         "acc. node lost", "diff (pt)", "wall (both)"], rows, markdown)


def plot(records: list[dict], directory) -> list[Path]:
    """World size over steps of the node-loss run (one line per record)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3))
    for i, r in enumerate(records):
        steps = [e["step"] for e in r["layouts"]] + [r["steps"]]
        worlds = [e["world_size"] for e in r["layouts"]]
        ax.step(steps, worlds + worlds[-1:], where="post", marker="o", linestyle=["-", "--", ":"][i % 3],
                label=f"{r['nodes']} nodes, killed at {r['killed_at_step']}")
    ax.set_xlabel("step")
    ax.set_ylabel("world size")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    fig.tight_layout()
    path = directory / "elastic.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
