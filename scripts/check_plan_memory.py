"""Measured ``model_state_bytes_per_rank`` (real gloo ranks, the Trainer, 2 steps) against distlab
plan's prediction, for every DP flavour and ZeRO stage, SGD and Adam, with and without gradient
accumulation. Exits 1 on any difference.

    .venv/bin/python scripts/check_plan_memory.py 3 mlp,small-cnn-bn,resnet18,vgg11
    .venv/bin/python scripts/check_plan_memory.py 2 vgg11-bn,vgg19,vgg19-bn
"""

import sys

from distlab import runtime
from distlab.parallel.cost import Optim
from distlab.plan.trace import trace
from distlab.parallel.zero.cost import zero_peak_bytes
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig

# (zero, optimizer, grad_accum, dp_sync)
CONFIGS = [(0, "adam", 1, "allreduce"), (0, "sgd", 1, "ddp"), (0, "adam", 1, "bucketed"), (1, "adam", 1, "allreduce"),
           (2, "sgd", 1, "allreduce"), (2, "adam", 2, "allreduce"), (3, "adam", 1, "allreduce"),
           (3, "sgd", 2, "allreduce")]


def shape(model: str) -> tuple[tuple[int, ...], str]:
    return ((1, 28, 28), "synthetic:1x28x28:10:64") if model == "mlp" else ((3, 32, 32), "synthetic:3x32x32:10:64")


def measure(rank, world, runs):
    out = []
    for model, zero, opt, accum, dp in runs:
        cfg = TrainConfig.from_flags(model=model, dataset=shape(model)[1], max_steps=2, global_batch_size=4 * world,
                          optimizer=opt, lr=0.01, zero=zero, grad_accum=accum, dp_sync=dp, progress=False,
                          verbose=False, eval_every_epoch=False, log_every=1, eval_batch_size=64)
        out.append(Trainer(cfg.validate(world), runtime.from_process_group()).fit()["model_state_bytes_per_rank"])
    return out


def main(world: int, models: list[str]) -> int:
    runs = [(m, *c) for m in models for c in CONFIGS]
    measured = run_ranks(measure, world, runs, timeout=900)[0]
    traces, bad = {}, 0
    for (model, zero, opt, accum, dp), got in zip(runs, measured):
        traces.setdefault(model, trace(model, shape(model)[0], 10))
        predicted = zero_peak_bytes(traces[model], zero, world, Optim.of(opt), accum)
        bad += predicted != got
        print(f"{model:<13} zero {zero} {opt:<5} accum {accum} {dp:<9} measured {got:>12,} predicted "
              f"{predicted:>12,} {'exact' if predicted == got else 'DIFFERENT'}", flush=True)
    print(f"{len(runs) - bad} of {len(runs)} exact on {world} ranks")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(int(sys.argv[1]), sys.argv[2].split(",")))
