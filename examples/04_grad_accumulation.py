"""Gradient accumulation: K small backward passes, one gradient sync, one step == one big batch.

    torchrun --standalone --nproc-per-node 2 examples/04_grad_accumulation.py

Each rank's slice of the global batch of 64 is split into K micro-batches; every micro-batch loss
is divided by K and backward *adds* into ``.grad``; the first K-1 run inside ``no_sync()`` so no
bytes move until the last one. The script checks the result against a single process taking one
step on the whole batch, and counts the bytes sent with and without ``no_sync``.
Tutorial: docs/04-grad-accumulation.md.
"""

import torch
import torch.nn.functional as F

from distlab import comm, runtime
from distlab.models import build_model
from distlab.parallel import DataParallel
from distlab.runtime import print0
from distlab.tools.verify import sgd_tolerance

STEPS, GLOBAL_BATCH = 10, 64


def model():
    torch.manual_seed(1)
    return build_model("mlp", (1, 28, 28), 10, widths=(128, 64))


def count(net) -> int:
    return sum(p.numel() for p in net.parameters())


def main() -> None:
    rt = runtime.init(device="cpu", threads=1)  # a CPU tutorial: gloo, even where GPUs exist
    rank, n = rt.rank, rt.world_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, GLOBAL_BATCH, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (STEPS, GLOBAL_BATCH), generator=g)

    single = model()  # the reference: one process, one step per whole batch of 64
    opt = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(single(x[s]), y[s]).backward()
        opt.step()

    print0(f"{n} ranks x local batch {GLOBAL_BATCH // n}, split into K micro-batches; {STEPS} SGD+momentum steps")
    for k in (1, 2, 4):
        for use_no_sync in (True, False):
            if k == 1 and not use_no_sync:
                continue
            net = model()
            dp = DataParallel(net, "bucketed", bucket_mb=1.0)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            with comm.counting() as sent:
                for s in range(STEPS):
                    opt.zero_grad()
                    xs, ys = x[s][rank::n], y[s][rank::n]
                    for i, (xm, ym) in enumerate(zip(xs.chunk(k), ys.chunk(k))):
                        last = i == k - 1
                        ctx = dp.no_sync() if (use_no_sync and not last) else torch.enable_grad()
                        with ctx:
                            (F.cross_entropy(dp(xm), ym) / k).backward()  # 1/K: the mean over the local batch
                        if not use_no_sync and not last:
                            dp.sync_gradients()  # a sync per micro-batch: correct, but K times the bytes
                    dp.sync_gradients()
                    opt.step()
            diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), single.parameters()))
            label = f"K={k}" + ("" if use_no_sync else " syncing every micro-batch")
            print0(f"  {label:<30} max |param - single process| {diff:.1e}   bytes sent per step {sent.bytes_sent / STEPS:,.0f}")
            assert diff <= sgd_tolerance(STEPS, 0.05, GLOBAL_BATCH, momentum=0.9), (k, diff)  # float32 bound
            assert sent.bytes_sent == STEPS * (1 if use_no_sync else k) * 2 * (n - 1) / n * 4 * count(net)
    print0("no_sync: the same parameters as one big batch, and one gradient sync per step whatever K is.\n"
           "Syncing every micro-batch gives the same parameters too (averaging is linear: the average of\n"
           "an already-averaged gradient plus the next micro-batch's is the average of both) but sends\n"
           "K times the bytes.")
    runtime.shutdown()


if __name__ == "__main__":
    main()
