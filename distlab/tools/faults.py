"""Fault drills (``distlab verify --faults``): real failures injected into real ``distlab train`` jobs.

For one strategy on N processes, an uninterrupted run (``straight``) is compared with runs that
suffer, each once:

* ``kill`` -- the last rank dies by SIGKILL right after a step mid-epoch; torchrun's agent
  (``--max-restarts 1``) restarts the group, which resumes from the newest snapshot on its own;
* ``kill-in-snapshot`` -- the last rank dies by SIGKILL after writing its file of a snapshot and
  before the snapshot is committed; the restarted group must resume from the *previous* one (the
  partial snapshot is never loaded) and clear it away;
* ``preempt`` -- SIGTERM reaches torchrun's agent (as Slurm or Kubernetes send it); every rank stops
  at one step, snapshots and exits 0; ``--resume auto`` finishes the run;
* ``reshard`` -- as ``preempt``, but the run is finished on half the processes (same global batch):
  the snapshot is resharded;
* ``disk-full`` -- snapshots go to a tmpfs with room for one and a half: the run must fail in one
  line naming the full disk, leaving the earlier snapshot intact (root only; skipped otherwise);
* ``link-cut`` (asked for by name: it builds an emulated cluster, root only) -- the job runs on two
  emulated nodes; mid-epoch every packet to and from node 1 is dropped (netem loss 100%: a cable
  pulled, the machine up). Every rank must fail within ``--comm-timeout`` (plus the few seconds of a
  roll call) with a line naming who is unreachable -- the ranks of node 0 name node 1's ranks, node
  1's ranks say they are cut off -- and, the link mended, ``--resume auto`` must finish bitwise.

``kill``, ``kill-in-snapshot`` and ``preempt`` must end *bitwise* equal to ``straight`` -- every
rank's final model and every logged loss: a resumed run replays exactly the float operations of an
uninterrupted one. ``reshard`` sums in another order after the switch, so it must agree within the
float32 rounding bound of :mod:`distlab.tools.verify` (twice it: both runs deviate from exact arithmetic).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from distlab.errors import ConfigError, DistlabError
from distlab.launch import prefork
from distlab.tools.flags import strategy_flags
from distlab.tools.verify import sgd_tolerance

DRILLS = ("kill", "kill-in-snapshot", "preempt", "reshard", "disk-full")  # what `--faults` alone runs
OPT_IN = ("link-cut",)
CUT_TIMEOUT_S = 10  # --comm-timeout of the link-cut drill
_HOOKS = ("DISTLAB_KILL_AT_STEP", "DISTLAB_KILL_IN_SNAPSHOT", "DISTLAB_TERM_AGENT_AT_STEP")


def tensors(obj):
    """Every tensor inside nested dicts/lists, in a fixed order."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors(item)


class _Job:
    """The ``distlab train`` command of one strategy's drills, and how to run and read it."""

    def __init__(self, case, world_size: int, steps: int, root: Path, timeout: float):
        self.case, self.world, self.steps, self.root, self.timeout = case, world_size, steps, root, timeout
        sync_bn = case.strategy.sync_bn != "off"
        self.model, self.dataset = ("small-cnn-bn", "synthetic:3x8x8:4:4096") if sync_bn else \
            ("mlp", "synthetic:1x16x16:10:4096")
        self.shape = ["--mlp-widths", "64,32"]
        if case.model in ("gpt", "gpt-moe"):  # the transformer (the sequence and expert layouts need it)
            self.model, self.dataset = case.model, "synthetic-text:20000"
            self.shape = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "16"]
        self.extra: list[str] = []
        if getattr(case, "grpo", False):  # GRPO: prompts, a reward, rollouts seeded per prompt (resumed: redrawn alike)
            from distlab.tools.verify_data import GRPO, GRPO_DATA
            self.dataset = GRPO_DATA
            self.extra = [part for k, v in GRPO.items() for part in (f"--{k.replace('_', '-')}", str(v))]
        self.batch = 16 * case.strategy.dp_size(world_size)
        self.lr = 0.003
        self.every, self.fault_step = max(1, steps // 4), steps // 2 + 1

    def command(self, world: int | None = None) -> list[str]:
        return [sys.executable, "-m", "distlab", "train", "--nproc-per-node", str(world or self.world),
                "--device", "cpu", "--model", self.model, *self.shape, "--dataset", self.dataset,
                "--global-batch-size", str(self.batch), "--max-steps", str(self.steps),
                "--snapshot-every", str(self.every), "--lr", str(self.lr), "--lr-schedule", "cosine",
                "--log-every", "1", "--no-progress", "--comm-timeout", "60", "--optimizer", self.case.optimizer,
                *strategy_flags(self.case.strategy), *self.extra]

    def run(self, name: str, extra: list[str] = (), env: dict | None = None, world: int | None = None,
            fresh: bool = True, expect: int | None = 0) -> subprocess.CompletedProcess:
        out = self.root / name
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        base_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", *_HOOKS)}
        proc = subprocess.run([*self.command(world), *extra, "--snapshot-dir", str(out / "snapshots"),
                               "--out", str(out / "run")],
                              capture_output=True, text=True, timeout=self.timeout, env={**base_env, **(env or {})})
        if expect is not None and proc.returncode != expect:
            raise ConfigError(f"the {name} run of {self.case.name} exited {proc.returncode}, not {expect}:\n"
                              f"{proc.stderr[-2000:]}")
        return proc

    def result(self, name: str) -> tuple[dict, list[torch.Tensor], list[float]]:
        """(summary, every rank's final model tensors, logged losses) of run ``name``."""
        from distlab.train import snapshot
        from distlab.train import snapshot_load
        out = self.root / name
        summary = json.loads((out / "run" / "summary.json").read_text())
        path = Path(summary["snapshot"])
        meta = snapshot.read_meta(path)
        models = [snapshot_load.load_rank_file(path, meta, r)["model"] for r in range(len(meta["files"]))]
        losses = [json.loads(line)["loss"] for line in (out / "run" / "metrics.jsonl").open()]
        return summary, [t for m in models for t in tensors(m)], losses


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.numel()), default=0.0)


def _bitwise_record(job: _Job, straight, name: str, drill: str, detail: str, ok: bool = True) -> dict:
    (_, a, a_losses), (summary, b, b_losses) = straight, job.result(name)
    same_shapes = [x.shape for x in a] == [y.shape for y in b]
    bitwise = same_shapes and all(torch.equal(x, y) for x, y in zip(a, b)) and a_losses == b_losses
    return {"drill": drill, "detail": detail, "max_abs_param_diff": _diff(a, b) if same_shapes else float("nan"),
            "max_loss_diff": max((abs(x - y) for x, y in zip(a_losses, b_losses)), default=0.0), "tolerance": 0.0,
            "bitwise": bitwise, "restarts": summary["restart_count"], "attempts": summary["attempts"],
            "resumed_from": summary["resumed_from"], "passed": bool(bitwise and ok)}


def drill_kill(job: _Job, straight) -> dict:
    job.run("killed", ["--max-restarts", "1"], {"DISTLAB_KILL_AT_STEP": f"{job.world - 1}:{job.fault_step}"})
    record = _bitwise_record(job, straight, "killed", "kill",
                             f"rank {job.world - 1} SIGKILLed after step {job.fault_step}")
    record["passed"] = record["passed"] and record["restarts"] == 1 and record["resumed_from"] is not None
    return record


def drill_kill_in_snapshot(job: _Job, straight) -> dict:
    at = 2 * job.every
    job.run("killed-in-snapshot", ["--max-restarts", "1"], {"DISTLAB_KILL_IN_SNAPSHOT": f"{job.world - 1}:{at}"})
    record = _bitwise_record(job, straight, "killed-in-snapshot", "kill-in-snapshot",
                             f"rank {job.world - 1} SIGKILLed while writing the snapshot of step {at}")
    leftovers = [p.name for p in (job.root / "killed-in-snapshot" / "snapshots").iterdir()
                 if p.name.startswith(".tmp-")]
    previous = str(record["resumed_from"] or "").endswith(f"step-{job.every:08d}")
    record["passed"] = record["passed"] and record["restarts"] == 1 and previous and not leftovers
    if leftovers:
        record["detail"] += f"; left behind: {', '.join(leftovers)}"
    return record


def drill_preempt(job: _Job, straight) -> dict:
    proc = job.run("preempted", env={"DISTLAB_TERM_AGENT_AT_STEP": f"{job.world - 1}:{job.fault_step}"})
    first = json.loads((job.root / "preempted" / "run" / "summary.json").read_text())
    job.run("preempted", ["--resume", "auto"], fresh=False)
    record = _bitwise_record(job, straight, "preempted", "preempt",
                             f"SIGTERM to torchrun's agent after step {job.fault_step}: stopped at step "
                             f"{first['steps']} (exit {proc.returncode}), then --resume auto")
    record["passed"] = record["passed"] and first["stopped"] == "preempted" and record["attempts"] == 2
    return record


def drill_reshard(job: _Job, straight) -> dict | None:
    to = job.world // 2
    try:
        if to < 1:
            return None
        job.case.strategy.check(to)
        job.case.strategy.check_batch(job.batch, to)
    except ConfigError:
        return None  # the layout does not fit on half the processes
    if job.case.optimizer != "sgd":
        # Another layout sums in another order, and only SGD has a rounding bound (distlab.tools.verify): the
        # drill runs its own uninterrupted and resharded jobs with SGD (momentum 0.9), same layout.
        job = _Job(dataclasses.replace(job.case, optimizer="sgd"), job.world, job.steps, job.root / "sgd", job.timeout)
        job.run("straight")
        straight = job.result("straight")
    job.run("resharded", env={"DISTLAB_TERM_AGENT_AT_STEP": f"{job.world - 1}:{job.fault_step}"})
    job.run("resharded", ["--resume", "auto"], world=to, fresh=False)
    from distlab.train.loading import whole_state
    summary, _, losses = job.result("resharded")
    a, _ = whole_state(straight[0]["snapshot"])
    b, _ = whole_state(summary["snapshot"])
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    tol = 2 * sgd_tolerance(job.steps, job.lr, job.batch, momentum=0.9)  # twice verify's bound: both runs round
    layouts = " -> ".join(f"{entry['world_size']} ranks from step {entry['step']}" for entry in summary["layouts"])
    twin = " (an SGD twin of the job: Adam has no rounding bound)" if job.root.name == "sgd" else ""
    return {"drill": "reshard", "detail": f"preempted, finished on {to} process(es): {layouts}{twin}",
            "max_abs_param_diff": diff, "max_loss_diff": max(abs(x - y) for x, y in zip(straight[2], losses)),
            "tolerance": tol, "bitwise": False, "restarts": 0, "attempts": summary["attempts"],
            "resumed_from": summary["resumed_from"],
            "passed": diff <= tol and [e["world_size"] for e in summary["layouts"]] == [job.world, to]}


def drill_disk_full(job: _Job, straight) -> dict | None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return {"drill": "disk-full", "detail": "skipped: a small tmpfs needs root and mount(8)", "passed": None}
    from distlab.train import snapshot, snapshot_load
    one = sum(f.stat().st_size for f in Path(straight[0]["snapshot"]).iterdir())
    disk = job.root / "disk-full" / "snapshots"
    shutil.rmtree(job.root / "disk-full", ignore_errors=True)
    disk.mkdir(parents=True)
    size = (int(1.5 * one) // 4096 + 1) * 4096
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        return {"drill": "disk-full", "detail": f"skipped: cannot mount a tmpfs ({mounted.stderr.strip()})",
                "passed": None}
    try:
        proc = job.run("disk-full", fresh=False, expect=None)
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        kept = snapshot.snapshots(disk)
        intact = len(kept) == 1
        if intact:
            meta = snapshot.read_meta(kept[0])
            for r in range(len(meta["files"])):
                snapshot_load.load_rank_file(kept[0], meta, r)
        ok = proc.returncode == 2 and len(errors) == 1 and "No space left on device" in errors[0] and intact
        return {"drill": "disk-full", "detail": (errors[0] if errors else proc.stderr[-300:]).strip()[:300],
                "passed": ok, "kept": [p.name for p in kept]}
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def drill_link_cut(job: _Job, straight) -> dict:
    import threading
    import time

    from distlab.launch import cluster as cl

    from distlab.launch import cluster_jobs as cl_jobs
    try:
        cl.check_capable()
    except DistlabError as exc:
        return {"drill": "link-cut", "detail": f"skipped: the emulated cluster cannot run here ({exc})",
                "passed": None}
    if job.world % 2:
        return {"drill": "link-cut", "detail": f"skipped: {job.world} processes do not split over 2 nodes",
                "passed": None}
    out = job.root / "link-cut"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    name = f"lc{os.getpid() % 10000}"
    base = [*job.command(job.world // 2), "--snapshot-dir", str(out / "snapshots"), "--out", str(out / "run")]
    base[base.index("--comm-timeout") + 1] = str(CUT_TIMEOUT_S)
    from distlab.runtime import cores
    per_rank = max(1, cores() // job.world)  # the threads each rank of `straight` had: the same float ops
    with cl.private(2, "1gbit", min(cores(), per_rank * (job.world // 2)), name):
        codes: dict = {}
        with open(out / "cut.log", "w") as log:
            runner = threading.Thread(target=lambda: codes.setdefault("cut", cl_jobs.run(
                [*base, "--max-restarts", "0"], name, job.timeout, out=log)), daemon=True)
            runner.start()
            metrics = out / "run" / "metrics.jsonl"
            while runner.is_alive() and (not metrics.is_file() or
                                         len(metrics.read_text().splitlines()) < job.fault_step):
                time.sleep(0.05)
            cut_at = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            t0 = time.perf_counter()
            cl_jobs.cut_link(1, name)
            runner.join(job.timeout)
            failed_after = time.perf_counter() - t0
        text = (out / "cut.log").read_text()
        cl_jobs.cut_link(1, name, restore=True)
        with open(out / "resume.log", "w") as log:
            resumed = cl_jobs.run([*base, "--resume", "auto"], name, job.timeout, out=log)
    per_node = job.world // 2
    lost = ", ".join(str(r) for r in range(per_node, job.world))
    named = f"rank{'s' if per_node > 1 else ''} {lost} did not answer a roll call"
    errors = [line.split("error: ", 1)[-1] for line in text.splitlines() if "communication failed" in line]
    named_ok = any(named in e for e in errors if e.startswith("rank 0:")) and \
        any("cut off from the job" in e for e in errors if e.startswith(f"rank {job.world - 1}:"))
    limit = CUT_TIMEOUT_S + 15  # the collective's timeout, the roll call (<= 5 s), agents' teardown
    record = {"drill": "link-cut", "cut_at_step": cut_at, "failed_after_s": failed_after,
              "comm_timeout_s": CUT_TIMEOUT_S, "exit_code": codes.get("cut"), "resume_exit_code": resumed,
              "errors": errors[:4]}
    if resumed != 0:
        return {**record, "detail": f"the resumed run failed (exit {resumed}): see {out / 'resume.log'}",
                "passed": False}
    record.update({k: v for k, v in _bitwise_record(job, straight, "link-cut", "link-cut", "").items()
                   if k not in ("detail", "passed")})
    record["detail"] = (f"node 1's link cut after step {cut_at}: every rank failed {failed_after:.1f} s later "
                        f"(--comm-timeout {CUT_TIMEOUT_S}); rank 0 said: "
                        f"{next((e for e in errors if e.startswith('rank 0:')), 'nothing')[:160]}")
    record["passed"] = bool(codes.get("cut") and named_ok and failed_after <= limit and record["bitwise"])
    return record


RUNNERS = {"kill": drill_kill, "kill-in-snapshot": drill_kill_in_snapshot, "preempt": drill_preempt,
           "reshard": drill_reshard, "disk-full": drill_disk_full, "link-cut": drill_link_cut}


def run_drills(case, world_size: int, steps: int, workdir: str, drills=DRILLS, timeout: float = 600.0) -> list[dict]:
    """Every drill in ``drills`` for one strategy; one record each (``passed`` None: skipped, with why)."""
    from distlab.runtime.device import machine_facts
    unknown = [d for d in drills if d not in RUNNERS]
    if unknown:
        raise ConfigError(f"unknown fault drill {unknown[0]!r}; choose from: {', '.join(DRILLS + OPT_IN)}")
    if steps < 8:
        raise ConfigError(f"fault drills need at least 8 steps (snapshots every steps/4, a fault after steps/2), "
                          f"not {steps}")
    job = _Job(case, world_size, steps, Path(workdir), timeout)
    records = []
    with prefork.shared():  # every drill's launches fork their workers from this process's server
        job.run("straight")
        straight = job.result("straight")
        done = [RUNNERS[drill](job, straight) for drill in drills]
    for drill, record in zip(drills, done):
        if record is None:
            record = {"drill": drill, "detail": f"skipped: {case.name} does not fit on {world_size // 2} process(es)",
                      "passed": None}
        records.append({"strategy": case.name, "flags": case.flags(), "world_size": world_size, "steps": steps,
                        "model": job.model, "global_batch_size": job.batch, **record, **machine_facts()})
    return records


def table(records: list[dict]) -> str:
    width = max([20] + [len(r["strategy"]) for r in records])
    rows = [f"{'strategy':<{width}} {'world':>5} {'drill':<16} {'max |dparam|':>12} {'tolerance':>9}  result  detail"]
    for r in records:
        if r["passed"] is None:
            rows.append(f"{r['strategy']:<{width}} {r['world_size']:>5} {r['drill']:<16} {'-':>12} {'-':>9}  SKIP    "
                        f"{r['detail']}")
            continue
        verdict = "PASS" if r["passed"] else "FAIL"
        diff = f"{r['max_abs_param_diff']:.2e}" if "max_abs_param_diff" in r else "-"
        tol = "bitwise" if r.get("bitwise") is not None and r.get("tolerance") == 0.0 else \
            (f"{r['tolerance']:.1e}" if "tolerance" in r else "-")
        rows.append(f"{r['strategy']:<{width}} {r['world_size']:>5} {r['drill']:<16} {diff:>12} {tol:>9}  "
                    f"{verdict:<6}  {r['detail']}")
    return "\n".join(rows)
