"""Synchronized batch norm: statistics of the global batch, forward and backward, on CPU.

    torchrun --standalone --nproc-per-node 2 examples/05_sync_batchnorm.py

A BatchNorm2d layer sees a global batch of 8 images split over the ranks. The reference is one
process normalising all 8 together. Plain BatchNorm on each rank normalises by its own slice's
mean and variance, so its outputs, input gradients and running statistics all differ from the
reference; distlab's SyncBatchNorm all-reduces ``[sum, sum of squares, count]`` in forward and
``[sum g, sum g*xhat]`` in backward, and matches it. Tutorial: docs/05-sync-batchnorm.md.
"""

import torch
from torch import nn

from distlab import comm, runtime
from distlab.parallel import convert_sync_batchnorm
from distlab.runtime import print0

GLOBAL_BATCH, CHANNELS = 8, 3


def run(layer: nn.Module, x: torch.Tensor, w: torch.Tensor):
    """Output, input gradient and parameter gradients of ``sum(w * layer(x))``."""
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (w * y).sum().backward()
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.running_mean.clone()


def main() -> None:
    rt = runtime.init(device="cpu", threads=1)  # a CPU tutorial: gloo, even where GPUs exist
    rank, n = rt.rank, rt.world_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH, CHANNELS, 4, 4, generator=g) * 3 + 5  # far from zero mean: a real test
    w = torch.randn(GLOBAL_BATCH, CHANNELS, 4, 4, generator=g)           # makes dL/dy non-trivial
    mine = slice(rank * GLOBAL_BATCH // n, (rank + 1) * GLOBAL_BATCH // n)

    ref_y, ref_dx, ref_dw, ref_rm = run(nn.BatchNorm2d(CHANNELS), x, w)  # one process, all 8 images
    print0(f"BatchNorm2d({CHANNELS}) on a global batch of {GLOBAL_BATCH}, {GLOBAL_BATCH // n} images per rank")
    for name, layer in (("plain BatchNorm", nn.BatchNorm2d(CHANNELS)),
                        ("distlab SyncBatchNorm", convert_sync_batchnorm(nn.BatchNorm2d(CHANNELS)))):
        with comm.counting() as sent:
            y, dx, dw, rm = run(layer, x[mine], w[mine])
        comm.all_reduce(dw, op="sum")  # data parallel sums the parameter gradients, as for any layer
        errs = {"output": (y - ref_y[mine]).abs().max(), "input grad": (dx - ref_dx[mine]).abs().max(),
                "weight grad": (dw - ref_dw).abs().max(), "running mean": (rm - ref_rm).abs().max()}
        errs = {k: comm.all_reduce(v.reshape(1), op="max").item() for k, v in errs.items()}
        print0(f"  {name:<22} " + "  ".join(f"{k} {v:.1e}" for k, v in errs.items())
               + f"   ({sent.bytes_sent:,} bytes of statistics sent)")
        if name.startswith("distlab"):
            assert max(errs.values()) < 1e-4, errs  # float32 rounding of sums over up to 128 values
        else:
            assert errs["output"] > 1e-2  # local statistics really are different
    print0("SyncBatchNorm matches one process on the whole batch; plain BatchNorm does not.")
    runtime.shutdown()


if __name__ == "__main__":
    main()
