"""``distlab bench checkpointing``: what activation checkpointing saves and what it costs.

Per model, one process trains the same steps from the same initial weights twice -- plainly, and with every
block checkpointed (:mod:`distlab.parallel.checkpointing`) -- and records per variant the median
time per step (first steps excluded) and the peak bytes autograd held for backward
(:class:`~distlab.parallel.pipeline.ActivationMeter`: the activations, parameters excepted), and
whether the first step's gradients are bit-for-bit equal. ``--runs`` repeats both variants,
interleaved; the ratios are of the medians, with the range over the rounds.

``--pp P --microbatches M`` runs each variant as a ``P``-stage 1F1B pipeline on ``P`` local
processes instead (one thread each): every stage recomputes the blocks it holds; the peak is the
largest stage's, the time the slowest rank's median step. ``--precision bf16`` runs both variants
under bfloat16 autocast.
"""

from __future__ import annotations

import statistics
import time

import torch

from distlab.bench.common import at_least, choose, format_table, machine, write
from distlab.errors import ConfigError, human_bytes
from distlab.launch.spawn import run_ranks
from distlab.models import build_model, task_loss
from distlab.parallel.checkpointing import apply_activation_checkpointing, block_names
from distlab.parallel.pipeline import ActivationMeter, PipelineStage
from distlab.parallel.precision import Precision

# name -> (model, input shape, classes or vocabulary, options)
WORKLOADS = {"vgg11-bn": ("vgg11-bn", (3, 32, 32), 10, {}), "resnet18": ("resnet18", (3, 32, 32), 10, {}),
             "gpt": ("gpt", (64,), 96, {"n_layer": 4})}


def _model_and_batch(name: str, batch: int):
    model_name, shape, classes, options = WORKLOADS[name]
    torch.manual_seed(0)
    model = build_model(model_name, shape, classes, **options)
    gen = torch.Generator().manual_seed(1)
    if model_name == "gpt":
        x = torch.randint(0, classes, (batch, *shape), generator=gen)
        y = torch.randint(0, classes, (batch, *shape), generator=gen)
    else:
        x, y = torch.randn(batch, *shape, generator=gen), torch.randint(0, classes, (batch,), generator=gen)
    return model.train(), x, y


def _measure(name: str, checkpointed: bool, steps: int, batch: int, precision: str = "fp32") -> dict:
    model, x, y = _model_and_batch(name, batch)
    if checkpointed:
        apply_activation_checkpointing(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = Precision(precision).autocast
    times, peak, first = [], 0, None
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ActivationMeter(model.parameters()) as meter:
            with autocast():
                loss = task_loss(model(x), y)
            loss.backward()
        if step == 0:
            first = [p.grad.clone() for p in model.parameters()]
        opt.step()
        times.append(time.perf_counter() - t0)
        peak = max(peak, meter.peak)
    skip = min(2, steps // 2)
    return {"time_per_step_s": statistics.median(times[skip:]), "activation_peak_bytes": peak, "grads": first}


def _pipeline_pair(rank: int, world: int, name: str, steps: int, batch: int, microbatches: int,
                   precision: str) -> dict:
    """On each rank of a ``world``-stage pipeline: both variants, plain first; this rank's numbers."""
    import torch.distributed as dist
    result, grads = {}, {}
    for checkpointed in (False, True):
        model, x, y = _model_and_batch(name, batch)
        stage = PipelineStage(model, dist.group.WORLD, microbatches, "1f1b",
                              checkpoint=block_names(model) if checkpointed else None)
        opt = torch.optim.SGD(stage.parameters(), lr=0.01, momentum=0.9)
        times, peak = [], 0
        for step in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            stage.train_step(x if stage.first else None, y if stage.last else None, task_loss,
                             precision=Precision(precision))
            if step == 0:
                grads[checkpointed] = [p.grad.clone() for p in stage.parameters()]
            opt.step()
            times.append(time.perf_counter() - t0)
            peak = max(peak, stage.last_timing["activation_peak_bytes"])
        skip = min(2, steps // 2)
        result["checkpointed" if checkpointed else "plain"] = {"time_per_step_s": statistics.median(times[skip:]),
                                                               "activation_peak_bytes": peak}
    result["equal"] = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    return result


def _measure_pipeline(name: str, steps: int, batch: int, pp: int, microbatches: int, precision: str) -> tuple:
    per_rank = run_ranks(_pipeline_pair, pp, name, steps, batch, microbatches, precision, timeout=1800, threads=1)
    out = {}
    for variant in ("plain", "checkpointed"):
        out[variant] = {"time_per_step_s": max(r[variant]["time_per_step_s"] for r in per_rank),
                        "activation_peak_bytes": max(r[variant]["activation_peak_bytes"] for r in per_rank),
                        "activation_peak_bytes_per_stage": [r[variant]["activation_peak_bytes"] for r in per_rank]}
    return out["plain"], out["checkpointed"], all(r["equal"] for r in per_rank)


def run(workloads=tuple(WORKLOADS), steps: int = 6, batch: int = 32, runs: int = 1, out=None,
        progress=print, pp: int = 1, microbatches: int | None = None, precision: str = "fp32") -> list[dict]:
    """Both variants of every workload, ``runs`` interleaved rounds; one record per workload."""
    workloads = choose("--workloads", workloads, WORKLOADS)
    at_least(steps=(steps, 2), batch=(batch, 1), runs=(runs, 1), pp=(pp, 1))
    microbatches = microbatches or pp
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision {precision}: this bench runs on the CPU; choose fp32 or bf16")
    if pp > 1 and batch % microbatches:
        raise ConfigError(f"--batch {batch} does not split into --microbatches {microbatches}; give a multiple")
    records = []
    for name in workloads:
        plain_t, ckpt_t, peaks, equal = [], [], {}, True
        for round_ in range(runs):
            progress(f"{name}: plain and checkpointed, batch {batch}" + (f", pp {pp} x {microbatches} micro-batches"
                                                                        if pp > 1 else "")
                     + (f", {precision}" if precision != "fp32" else "")
                     + (f" (round {round_ + 1} of {runs})" if runs > 1 else ""))
            if pp > 1:
                plain, ckpt, same = _measure_pipeline(name, steps, batch, pp, microbatches, precision)
            else:
                plain, ckpt = _measure(name, False, steps, batch, precision), _measure(name, True, steps, batch, precision)
                same = all(torch.equal(a, b) for a, b in zip(plain["grads"], ckpt["grads"]))
            plain_t.append(plain["time_per_step_s"])
            ckpt_t.append(ckpt["time_per_step_s"])
            peaks = {"plain": plain["activation_peak_bytes"], "checkpointed": ckpt["activation_peak_bytes"]}
            stages = {k: v["activation_peak_bytes_per_stage"] for k, v in (("plain", plain), ("checkpointed", ckpt))
                      if "activation_peak_bytes_per_stage" in v}
            equal = equal and same
        ratios = [c / p for c, p in zip(ckpt_t, plain_t)]
        records.append({"workload": name, "batch": batch, "steps": steps, "runs": runs, "precision": precision,
                        **({"pp": pp, "microbatches": microbatches, "schedule": "1f1b",
                            "activation_peak_bytes_per_stage_plain": stages["plain"],
                            "activation_peak_bytes_per_stage_checkpointed": stages["checkpointed"]} if pp > 1 else {}),
                        "time_per_step_s_plain": statistics.median(plain_t),
                        "time_per_step_s_checkpointed": statistics.median(ckpt_t),
                        "time_ratio": statistics.median(ckpt_t) / statistics.median(plain_t),
                        "time_ratio_range": [min(ratios), max(ratios)],
                        "activation_peak_bytes_plain": peaks["plain"],
                        "activation_peak_bytes_checkpointed": peaks["checkpointed"],
                        "gradients_bitwise_equal": equal,
                        **(machine(pp, 1) if pp > 1 else machine(1, torch.get_num_threads()))})
    write(records, out, "checkpointing")
    return records


def table(records: list[dict], markdown: bool = False) -> str:
    rows = [[r["workload"] + (f" pp {r['pp']} x mb {r['microbatches']}" if r.get("pp", 1) > 1 else "")
             + (f" {r['precision']}" if r.get("precision", "fp32") != "fp32" else ""), str(r["batch"]), human_bytes(r["activation_peak_bytes_plain"]),
             human_bytes(r["activation_peak_bytes_checkpointed"]),
             f"{r['activation_peak_bytes_checkpointed'] / r['activation_peak_bytes_plain']:.2f}x",
             f"{1000 * r['time_per_step_s_plain']:.1f}", f"{1000 * r['time_per_step_s_checkpointed']:.1f}",
             f"{r['time_ratio']:.2f}x" + (f" ({r['time_ratio_range'][0]:.2f}-{r['time_ratio_range'][1]:.2f})"
                                          if r["runs"] > 1 else ""),
             "yes" if r["gradients_bitwise_equal"] else "NO"] for r in records]
    return format_table(["workload", "batch", "activations", "checkpointed", "ratio", "ms/step", "ckpt ms/step",
                         "time ratio", "same grads"], rows, markdown)
