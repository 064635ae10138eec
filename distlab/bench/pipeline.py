"""``distlab bench pipeline``: distlab's pipeline schedules beside ``torch.distributed.pipelining``.

The GPT on synthetic text, cut into ``--nproc`` stages by :func:`~distlab.parallel.partition`
(the same split for both implementations), trains ``--steps`` SGD steps of ``--batch`` sequences
for each schedule and each micro-batch count ``M``: distlab's
:class:`~distlab.parallel.PipelineStage` and torch's ``PipelineStage``, the same model, seed and
batches. Interleaved over ``--runs`` rounds. The schedules, distlab's / torch's:

==================  =================================================================================
``gpipe``           GPipe / ``ScheduleGPipe``
``1f1b``            1F1B / ``Schedule1F1B``
``interleaved``     interleaved 1F1B, ``--virtual`` V chunks per rank / ``ScheduleInterleaved1F1B``
                    with V stages per rank (``M`` a multiple of the stages)
``zb``              zero bubble (ZB-H1), one chunk per rank / none (torch's zero-bubble schedules
                    need several stages per rank): distlab's alone
``interleaved-zb``  zero bubble with V chunks per rank / ``ScheduleInterleavedZeroBubble``
==================  =================================================================================

With ``P x V`` chunks the GPT gets at least ``P V - 2`` blocks (every chunk a layer).

Per run: median step time (the first steps excluded), the step losses (equal across the two
implementations up to float rounding: the same computation), and for distlab the measured bubble
(time the busiest stage waits for a neighbour, over the step), the ideal ``(P - 1) / (M + P - 1)``,
the most micro-batches a stage held at once, and the bytes each stage sends per step (torch sends
the same activations and gradients); for both, each stage's peak activation memory (the storages
autograd saved for backward, measured by :class:`~distlab.parallel.pipeline.ActivationMeter`). torch's ``Schedule1F1B`` needs ``M >= P``; smaller ``M`` runs
distlab's alone.

``--implementations distlab-actions`` runs GPipe and 1F1B through the action-list executor that plays the
interleaved and zero-bubble schedules (``PipelineStage.by_actions``) instead of their plain loops
(:mod:`distlab.parallel.pipeline.plain`): the same order, bit for bit, and its time against the loops'
(``vs_plain``).
"""

from __future__ import annotations

import statistics
import time

import torch

from distlab.bench.common import at_least, choose, cores, format_table, machine, write
from distlab.errors import human_bytes
from distlab.launch.spawn import run_ranks
from distlab.parallel.pipeline import ideal_bubble

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "interleaved-zb")
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "interleaved-zb": "ScheduleInterleavedZeroBubble"}  # zb: torch has no single-stage zero bubble
IMPLEMENTATIONS = ("distlab", "distlab-actions", "torch")  # distlab-actions: GPipe and 1F1B by the executor
MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)  # 6 layers: embedding, 4 blocks, head


def _mine(schedule: str, virtual: int) -> tuple[str, int]:
    """distlab's ``pp_schedule`` and chunks per rank for a bench schedule."""
    return {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved": ("1f1b", virtual), "zb": ("zb", 1),
            "interleaved-zb": ("zb", virtual)}[schedule]


def _layers(world: int, virtual: int) -> int:
    """Blocks of the bench GPT: the default 4, or enough that every one of ``P V`` chunks gets a layer."""
    return max(MODEL["n_layer"], world * virtual - 2)


def _batches(steps: int, batch: int, seed: int = 0):
    from distlab.data import load_dataset
    data = load_dataset("synthetic-text:100000", "train", seed=seed, block_size=MODEL["block_size"])
    g = torch.Generator().manual_seed(seed)
    return [data.batch(torch.randint(0, len(data), (batch,), generator=g)) for _ in range(steps)]


def _one(rank: int, world: int, impl: str, schedule: str, microbatches: int, steps: int, batch: int,
         warmup: int, virtual: int = 2) -> dict:
    import torch.distributed as dist

    from distlab import comm
    from distlab.models import GPT, task_loss
    from distlab.parallel import PipelineStage, partition
    from distlab.parallel.pipeline import ActivationMeter

    torch.manual_seed(0)
    model = GPT(256, MODEL["block_size"], _layers(world, virtual), MODEL["n_head"], MODEL["n_embd"])
    pp_schedule, chunks = _mine(schedule, virtual)
    first, last = rank == 0, rank == world - 1
    if impl != "torch":
        stage = PipelineStage(model, dist.group.WORLD, microbatches, pp_schedule, virtual=chunks)
        stage.by_actions = impl == "distlab-actions"  # the plain loop's schedule played from its action list
        params = stage.parameters()
    else:
        from torch.distributed import pipelining
        from torch.distributed.pipelining import PipelineStage as TorchStage
        ranges = partition(model, world * chunks)
        subs = [torch.nn.Sequential(*[model[i] for i in range(*ranges[c * world + rank])]) for c in range(chunks)]
        tstages = [TorchStage(sub, c * world + rank, world * chunks, torch.device("cpu"), group=dist.group.WORLD)
                   for c, sub in enumerate(subs)]
        kind = getattr(pipelining, TORCH[schedule])
        sched = kind(tstages if chunks > 1 else tstages[0], microbatches, loss_fn=task_loss)
        sub = torch.nn.ModuleList(subs)
        params = sub.parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    times, losses, sent, bubbles, held, activations = [], [], [], [], [], []
    for x, y in _batches(steps, batch):
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        with comm.counting() as c:
            if impl != "torch":
                loss = stage.train_step(x if first else None, y if last else None, task_loss)
            else:
                out: list = []
                with ActivationMeter(sub.parameters()) as meter:  # what distlab's stage measures of itself
                    if first:
                        sched.step(x)
                    elif last:
                        sched.step(target=y, losses=out)
                    else:
                        sched.step()
                activations.append(meter.peak)
                loss = torch.stack(out).mean().detach() if last else None
        opt.step()
        times.append(time.perf_counter() - t0)
        sent.append(c.bytes_sent)
        if last:
            losses.append(float(loss))
        if impl != "torch":
            bubbles.append(stage.last_timing["bubble_measured"])
            held.append(stage.last_timing["in_flight_peak"])
            activations.append(stage.last_timing["activation_peak_bytes"])
    timed = times[warmup:] or times
    return {"rank": rank, "step_s": statistics.median(timed), "losses": losses,
            "bubble": statistics.median(bubbles[warmup:] or bubbles) if bubbles else None,
            "held": max(held) if held else None, "activation_peak_bytes": max(activations), "sent": statistics.median(sent) if impl != "torch" else None}


def _cells(rank: int, world: int, cells: list[tuple], steps: int, batch: int, warmup: int,
           virtual: int = 2) -> list[dict]:
    """Every (implementation, schedule, M) cell in one process group, one after another."""
    return [_one(rank, world, impl, schedule, m, steps, batch, warmup, virtual) for impl, schedule, m in cells]


def _fits(impl: str, schedule: str, m: int, nproc: int) -> bool:
    """Whether a cell can run: torch's 1F1B needs M >= P, interleaving M a multiple of P, and torch
    has no single-stage zero bubble; the executor is measured against the plain loops (GPipe, 1F1B) alone."""
    if impl == "distlab-actions" and schedule not in ("gpipe", "1f1b"):
        return False
    if impl == "torch" and (schedule not in TORCH or (schedule == "1f1b" and m < nproc)):
        return False
    return not (schedule.startswith("interleaved") and m % nproc)


def run(nproc: int, microbatches: list[int], schedules: list[str], impls: list[str], steps: int, batch: int,
        runs: int, out: str | None, progress=None, virtual: int = 2) -> list[dict]:
    schedules = choose("--schedules", schedules, SCHEDULES)
    impls = choose("--implementations", impls, IMPLEMENTATIONS)
    at_least(nproc=(nproc, 2), steps=(steps, 2), runs=(runs, 1), virtual=(virtual, 2))
    from distlab.errors import ConfigError
    for m in microbatches:
        if m < 1 or batch % m:
            raise ConfigError(f"--batch {batch} must split into every --microbatches value; {m} does not divide it")
    threads = max(1, cores() // nproc)
    warmup = min(3, steps // 3)
    todo = [(impl, schedule, m) for schedule in schedules for m in microbatches for impl in impls
            if _fits(impl, schedule, m, nproc)]
    cells: dict[tuple, list[dict]] = {}
    for i in range(runs):
        if progress:
            progress(f"round {i + 1} of {runs}: {len(todo)} runs on {nproc} stages")
        per_rank = run_ranks(_cells, nproc, todo, steps, batch, warmup, virtual, timeout=1800, threads=threads)
        for k, (impl, schedule, m) in enumerate(todo):
            ranks = [results[k] for results in per_rank]
            cells.setdefault((schedule, m, impl), []).append({
                "step_s": max(r["step_s"] for r in ranks), "losses": ranks[-1]["losses"],
                "bubble": max((r["bubble"] for r in ranks if r["bubble"] is not None), default=None),
                "held": [r["held"] for r in ranks], "activations": [r["activation_peak_bytes"] for r in ranks],
                "sent": [r["sent"] for r in ranks]})
    records = []
    for (schedule, m, impl), rounds in cells.items():
        times = [r["step_s"] for r in rounds]
        first = rounds[0]
        pp_schedule, chunks = _mine(schedule, virtual)
        records.append({"schedule": schedule, "microbatches": m, "implementation": impl, "stages": nproc,
                        "virtual": chunks, "model": "gpt", **MODEL, "n_layer": _layers(nproc, virtual),
                        "batch": batch, "steps": steps,
                        "time_per_step_s_median": statistics.median(times), "time_per_step_s_runs": times,
                        "losses": first["losses"], "bubble_measured": first["bubble"],
                        "bubble_ideal": ideal_bubble(nproc, m, pp_schedule, chunks),
                        "microbatches_held_per_stage": first["held"],
                        "activation_peak_bytes_per_stage": first["activations"],
                        "bytes_sent_per_stage": first["sent"], **machine(nproc, threads)})
    by_key = {(r["schedule"], r["microbatches"], r["implementation"]): r for r in records}
    for r in records:  # distlab's against torch's; the executor against the plain loop (its losses: bitwise)
        beside = {"distlab": ("torch", "vs_torch"), "distlab-actions": ("distlab", "vs_plain")}
        against, key = beside.get(r["implementation"], (None, None))
        other = by_key.get((r["schedule"], r["microbatches"], against))
        if other:
            r[key] = r["time_per_step_s_median"] / other["time_per_step_s_median"]
            ratios = [a / b for a, b in zip(r["time_per_step_s_runs"], other["time_per_step_s_runs"])]
            r[f"{key}_range"] = [min(ratios), max(ratios)]
            r[f"max_loss_diff_{key}"] = max(abs(a - b) for a, b in zip(r["losses"], other["losses"]))
    write(records, out, "pipeline")
    return records


def table(records: list[dict], markdown: bool = False) -> str:
    rows = []
    for r in records:
        key = "vs_plain" if r.get("vs_plain") else "vs_torch"
        ratio = f"{r[key]:.2f}x ({r[key + '_range'][0]:.2f}-{r[key + '_range'][1]:.2f})" if r.get(key) else "-"
        rows.append([r["schedule"], str(r["microbatches"]), r["implementation"],
                     f"{1000 * r['time_per_step_s_median']:.1f}", ratio,
                     f"{r['bubble_measured']:.2f}" if r.get("bubble_measured") is not None else "-",
                     f"{r['bubble_ideal']:.2f}",
                     "/".join(map(str, r["microbatches_held_per_stage"])) if r["implementation"] != "torch" else "-",
                     "/".join(human_bytes(b) for b in r["activation_peak_bytes_per_stage"])
                     if r.get("activation_peak_bytes_per_stage") else "-",
                     f"{r['losses'][-1]:.4f}",
                     f"{r['max_loss_diff_' + key]:.1e}" if "max_loss_diff_" + key in r else "-"])
    return format_table(["schedule", "M", "implementation", "ms/step", "vs torch, or the plain loop (range)", "bubble",
                         "ideal", "held per stage", "activations per stage", "last loss", "|loss - theirs|"], rows,
                        markdown)


def plot(records: list[dict], directory) -> list:
    from pathlib import Path

    from distlab.tools.plots import integer_ticks, pyplot, style
    plt = pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    i = 0
    for schedule in dict.fromkeys(r["schedule"] for r in records):
        for impl in dict.fromkeys(r["implementation"] for r in records):
            rs = sorted((r for r in records if r["schedule"] == schedule and r["implementation"] == impl),
                        key=lambda r: r["microbatches"])
            a.plot([r["microbatches"] for r in rs], [1000 * r["time_per_step_s_median"] for r in rs],
                   label=f"{impl} {schedule}", **style(i))
            i += 1
            if impl != "torch":
                b.plot([r["microbatches"] for r in rs], [r["bubble_measured"] for r in rs],
                       label=f"measured, {schedule}", **style(i))
    ms = sorted({r["microbatches"] for r in records})
    p = records[0]["stages"]
    b.plot(ms, [(p - 1) / (m + p - 1) for m in ms], color="black", linestyle="--", label="(P-1)/(M+P-1)")
    a.set(xlabel="micro-batches M", ylabel="ms per step (median)", title=f"pipeline step time, {p} stages")
    b.set(xlabel="micro-batches M", ylabel="bubble (share of the step waiting)", title="pipeline bubble")
    for ax in (a, b):
        integer_ticks(ax, ms)
        ax.legend(fontsize=7)
    path = directory / "pipeline.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
