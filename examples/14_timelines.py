"""Timelines: where each rank's step goes -- compute, communication, waiting -- measured, not predicted.

    torchrun --standalone --nproc-per-node 2 examples/14_timelines.py

Trains the same small MLP a few steps per layout with ``--trace`` on (the Trainer, as ``distlab train``
runs it) and reads each trace back (``distlab.plan.timeline_analysis.analyze``):

1. data parallel three ways: gather-scatter and per-parameter all-reduce communicate after the
   backward (nothing hidden), bucketed starts each bucket's all-reduce while the backward computes
   the earlier layers' gradients;
2. ZeRO-3 with and without prefetching the next module's parameters;
3. a two-stage pipeline under GPipe, 1F1B, interleaved 1F1B and zero bubble: each stage's waits for
   its neighbour (the measured bubble) beside the schedule's ideal one;
4. one rank made slower on purpose (it sleeps 20 ms before each step): the other waits for it in
   every collective, and the trace names it.

The traces go to ``timelines/NAME/trace.json`` (open one in https://ui.perfetto.dev). About 30 s on
2 cores.
"""

import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import runtime
from distlab.parallel.pipeline import ideal_bubble
from distlab.runtime import print0, shutdown
from distlab.plan.timeline_analysis import analyze
from distlab.train import Trainer, TrainConfig

OUT = Path("timelines")


def traced(name: str, hooks=(), before=None, **settings) -> dict:
    """A run of 6 steps, steps 3-6 traced; what its trace says (every rank gets the same)."""
    cfg = TrainConfig.from_flags(**{**dict(model="mlp", mlp_widths=(512, 256, 128), dataset="synthetic:1x16x16:4:960",
                                           global_batch_size=64, max_steps=6, epochs=1, lr=0.05, seed=0,
                                           progress=False, verbose=False, eval_every_epoch=False,
                                           out=str(OUT / name), trace="3:6"), **settings})
    trainer = Trainer(cfg.validate(dist.get_world_size()), runtime.from_process_group(), hooks=list(hooks))
    if before:
        before(trainer)
    trainer.fit()
    import json
    return analyze(json.loads((OUT / name / "trace.json").read_text()))


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()

    print0("1. data parallel: how much of the gradient communication hides behind the backward")
    for method in ("gather-scatter", "allreduce", "bucketed"):
        found = traced(method, dp_sync=method, bucket_mb=0.25)
        print0(f"   {method:<15} hidden {100 * found['hidden_communication']:5.1f}%   exposed "
               f"{ms(found['exposed_communication_s_per_step'])} per step")
        if method != "bucketed":
            assert found["hidden_communication"] == 0.0, found
        else:
            assert found["hidden_communication"] > 0.0, found

    print0("2. ZeRO-3: gathers of the next module's parameters started early (prefetch) or on demand")
    for prefetch in (False, True):
        def switch(trainer, on=prefetch):
            trainer.engine.grad_sync.prefetch = on
        found = traced(f"zero3-{'prefetch' if prefetch else 'on-demand'}", before=switch, zero=3)
        print0(f"   prefetch {'on ' if prefetch else 'off'}  hidden {100 * found['hidden_communication']:5.1f}%   "
               f"exposed {ms(found['exposed_communication_s_per_step'])} per step")

    print0("3. a two-stage pipeline, 8 micro-batches: each stage's waits over its schedule (the bubble)")
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("zb", 1)):
        name = {"zb": "zero bubble"}.get(schedule, schedule) + ("-interleaved" if virtual > 1 else "")
        found = traced(f"pp-{name.replace(' ', '-')}", pp=2, microbatches=8, pp_schedule=schedule, pp_virtual=virtual,
                       dp_sync="allreduce")
        stages = ", ".join(f"{100 * r['pipeline_wait_fraction']:.0f}%" for r in found["ranks"])
        print0(f"   {name:<17} waits per stage {stages}   formula {100 * ideal_bubble(2, 8, schedule, virtual):.0f}%")

    print0("4. rank 1 sleeps 20 ms before each step: rank 0 waits for it in every all-reduce")

    def slow(step):
        if rank == 1:
            time.sleep(0.02)
    found = traced("slow-rank", hooks=[slow], dp_sync="bucketed", bucket_mb=0.25)
    exposed = [r["exposed_communication_s_per_step"] for r in found["ranks"]]
    print0(f"   exposed communication per step: rank 0 {ms(exposed[0])}, rank 1 {ms(exposed[1])}; "
           f"the slowest rank: {found['slowest_rank']}")
    assert found["slowest_rank"] == 1 and exposed[0] > exposed[1], found  # the fast rank waits in its all-reduces
    print0(f"traces in {OUT}/*/trace.json: open one in https://ui.perfetto.dev or chrome://tracing")
    shutdown()


if __name__ == "__main__":
    main()
