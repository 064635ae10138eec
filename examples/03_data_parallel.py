"""Data parallel three ways -- by hand, bucketed with overlap, torch's DDP -- each equal to one process.

    torchrun --standalone --nproc-per-node 2 examples/03_data_parallel.py

Every rank holds the whole model and computes gradients on its own slice of each global batch;
averaging the gradients over the ranks makes every rank's step the single-process step on the
whole batch. The script trains the same MLP for 30 SGD steps with (1) a loop that all-reduces
each gradient by hand, (2) distlab's bucketed sync, which all-reduces buckets of gradients
*during* backward, and (3) torch's DistributedDataParallel; then compares each with a single
process trained on the global batches. Tutorial: docs/03-data-parallel.md.
"""

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import comm, runtime
from distlab.models import build_model
from distlab.parallel import DataParallel
from distlab.runtime import print0
from distlab.tools.verify import sgd_tolerance

STEPS, GLOBAL_BATCH, LR = 30, 64, 0.05


def data():
    """The same 'dataset' on every rank: 30 global batches of 64 fake 28x28 images."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, GLOBAL_BATCH, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (STEPS, GLOBAL_BATCH), generator=g)
    return x, y


def fresh_model():
    torch.manual_seed(1)  # the same initial weights on every rank (DataParallel also broadcasts rank 0's)
    return build_model("mlp", (1, 28, 28), 10, widths=(128, 64))


def train(kind: str, rank: int, n: int):
    x, y = data()
    model = fresh_model()
    wrapped = None if kind in ("by hand", "single process") else \
        DataParallel(model, "bucketed" if kind == "bucketed" else "ddp", bucket_mb=0.1)
    net = wrapped if wrapped is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    times = []
    with comm.counting() as sent:
        for step in range(STEPS):
            t0 = time.perf_counter()
            # this rank's slice of the global batch: samples rank, rank+n, rank+2n, ...
            xs, ys = (x[step], y[step]) if kind == "single process" else (x[step][rank::n], y[step][rank::n])
            opt.zero_grad()
            F.cross_entropy(net(xs), ys).backward()
            if kind == "by hand":
                for p in model.parameters():      # the whole idea of data parallel, in two lines
                    dist.all_reduce(p.grad)       # sum of every rank's gradient ...
                    p.grad /= n                   # ... averaged: the gradient of the global batch
            elif wrapped is not None:
                wrapped.sync_gradients()          # bucketed: waits for the buckets sent during backward
            opt.step()
            times.append(time.perf_counter() - t0)
    return [p.detach().clone() for p in model.parameters()], sorted(times)[len(times) // 2], sent.bytes_sent


def main() -> None:
    rt = runtime.init(device="cpu", threads=1)  # a CPU tutorial: gloo, even where GPUs exist
    rank, n = rt.rank, rt.world_size
    reference, t_single, _ = train("single process", rank, n)  # every rank can afford the reference run
    print0(f"{n} ranks, MLP 784-128-64-10, global batch {GLOBAL_BATCH} ({GLOBAL_BATCH // n} per rank), {STEPS} SGD steps")
    print0(f"  {'single process':<15} median step {t_single * 1e3:6.2f} ms")
    for kind in ("by hand", "bucketed", "ddp"):
        params, t_step, sent = train(kind, rank, n)
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        print0(f"  {kind:<15} median step {t_step * 1e3:6.2f} ms   max |param - single process| {diff:.1e}")
        if kind == "bucketed":
            grads = sum(p.numel() * 4 for p in params)
            print0(f"  {'':<15} bytes sent per step {sent / STEPS:,.0f} = 2(n-1)/n x {grads:,} bytes of gradients")
        bound = sgd_tolerance(STEPS, LR, GLOBAL_BATCH)  # float32 summation order, derived in distlab.tools.verify
        assert diff <= bound, f"{kind} drifted from single-process training by {diff} (bound {bound:.1e})"
    print0("all three equal single-process training up to float32 rounding")
    runtime.shutdown()


if __name__ == "__main__":
    main()
