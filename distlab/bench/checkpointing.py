"""``distlab bench checkpointing``: what activation checkpointing saves and what it costs.

Per model, one process trains the same steps from the same initial weights twice -- plainly, and with every
block checkpointed (:mod:`distlab.parallel.checkpointing`) -- and records per variant the median
time per step (first steps excluded) and the peak bytes autograd held for backward
(:class:`~distlab.parallel.pipeline.ActivationMeter`: the activations, parameters excepted), and
whether the first step's gradients are bit-for-bit equal. ``--runs`` repeats both variants,
interleaved; the ratios are of the medians, with the range over the rounds.
"""

from __future__ import annotations

import statistics
import time

import torch

from distlab.bench.common import at_least, choose, format_table, human_bytes, machine, write
from distlab.models import build_model, task_loss
from distlab.parallel.checkpointing import apply_activation_checkpointing
from distlab.parallel.pipeline import ActivationMeter

# name -> (model, input shape, classes or vocabulary, options)
WORKLOADS = {"vgg11-bn": ("vgg11-bn", (3, 32, 32), 10, {}), "resnet18": ("resnet18", (3, 32, 32), 10, {}),
             "gpt": ("gpt", (64,), 96, {"n_layer": 4})}


def _measure(name: str, checkpointed: bool, steps: int, batch: int) -> dict:
    model_name, shape, classes, options = WORKLOADS[name]
    torch.manual_seed(0)
    model = build_model(model_name, shape, classes, **options)
    if checkpointed:
        apply_activation_checkpointing(model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    if model_name == "gpt":
        x = torch.randint(0, classes, (batch, *shape), generator=gen)
        y = torch.randint(0, classes, (batch, *shape), generator=gen)
    else:
        x, y = torch.randn(batch, *shape, generator=gen), torch.randint(0, classes, (batch,), generator=gen)
    times, peak, first = [], 0, None
    for step in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ActivationMeter(model.parameters()) as meter:
            task_loss(model(x), y).backward()
        if step == 0:
            first = [p.grad.clone() for p in model.parameters()]
        opt.step()
        times.append(time.perf_counter() - t0)
        peak = max(peak, meter.peak)
    skip = min(2, steps // 2)
    return {"time_per_step_s": statistics.median(times[skip:]), "activation_peak_bytes": peak, "grads": first}


def run(workloads=tuple(WORKLOADS), steps: int = 6, batch: int = 32, runs: int = 1, out=None,
        progress=print) -> list[dict]:
    """Both variants of every workload, ``runs`` interleaved rounds; one record per workload."""
    workloads = choose("--workloads", workloads, WORKLOADS)
    at_least(steps=(steps, 2), batch=(batch, 1), runs=(runs, 1))
    records = []
    for name in workloads:
        plain_t, ckpt_t, peaks, equal = [], [], {}, True
        for round_ in range(runs):
            progress(f"{name}: plain and checkpointed, batch {batch}" + (f" (round {round_ + 1} of {runs})"
                                                                        if runs > 1 else ""))
            plain = _measure(name, False, steps, batch)
            ckpt = _measure(name, True, steps, batch)
            plain_t.append(plain["time_per_step_s"])
            ckpt_t.append(ckpt["time_per_step_s"])
            peaks = {"plain": plain["activation_peak_bytes"], "checkpointed": ckpt["activation_peak_bytes"]}
            equal = equal and all(torch.equal(a, b) for a, b in zip(plain["grads"], ckpt["grads"]))
        ratios = [c / p for c, p in zip(ckpt_t, plain_t)]
        records.append({"workload": name, "batch": batch, "steps": steps, "runs": runs,
                        "time_per_step_s_plain": statistics.median(plain_t),
                        "time_per_step_s_checkpointed": statistics.median(ckpt_t),
                        "time_ratio": statistics.median(ckpt_t) / statistics.median(plain_t),
                        "time_ratio_range": [min(ratios), max(ratios)],
                        "activation_peak_bytes_plain": peaks["plain"],
                        "activation_peak_bytes_checkpointed": peaks["checkpointed"],
                        "gradients_bitwise_equal": equal, **machine(1, torch.get_num_threads())})
    write(records, out, "checkpointing")
    return records


def table(records: list[dict], markdown: bool = False) -> str:
    rows = [[r["workload"], str(r["batch"]), human_bytes(r["activation_peak_bytes_plain"]),
             human_bytes(r["activation_peak_bytes_checkpointed"]),
             f"{r['activation_peak_bytes_checkpointed'] / r['activation_peak_bytes_plain']:.2f}x",
             f"{1000 * r['time_per_step_s_plain']:.1f}", f"{1000 * r['time_per_step_s_checkpointed']:.1f}",
             f"{r['time_ratio']:.2f}x" + (f" ({r['time_ratio_range'][0]:.2f}-{r['time_ratio_range'][1]:.2f})"
                                          if r["runs"] > 1 else ""),
             "yes" if r["gradients_bitwise_equal"] else "NO"] for r in records]
    return format_table(["workload", "batch", "activations", "checkpointed", "ratio", "ms/step", "ckpt ms/step",
                         "time ratio", "same grads"], rows, markdown)
