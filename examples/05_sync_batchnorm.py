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
from distlab.tools.verify import sum_tolerance

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
    # Float32 rounding alone, for sums over a channel's N = 128 values in another order: outputs,
    # input gradients and running means come from four means (a sum's bound over N), at most
    # x^2 / std in size; weight gradients are sums of w * (normalised x) -- verify.sum_tolerance.
    values = x.numel() // CHANNELS
    std = x.transpose(0, 1).reshape(CHANNELS, -1).std(dim=1).min().item()
    xhat = (x - x.mean(dim=(0, 2, 3), keepdim=True)) / std
    bound = {"output": sum_tolerance(4 * values, x.abs().max().item() ** 2 / min(1.0, std)) / values,
             "weight grad": sum_tolerance(values, (w * xhat).abs().max().item())}
    bound["input grad"] = bound["running mean"] = bound["output"]
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
            assert all(errs[k] <= bound[k] for k in errs), (errs, bound)  # rounding only
        else:
            assert all(errs[k] > bound[k] for k in ("output", "input grad")), (errs, bound)  # really different
    print0("SyncBatchNorm matches one process on the whole batch; plain BatchNorm does not.")
    runtime.shutdown()


if __name__ == "__main__":
    main()
