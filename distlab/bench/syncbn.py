"""``distlab bench syncbn``: distlab's SyncBatchNorm vs plain local BatchNorm (and torch's SyncBN on GPU).

Grid: workers x features x global batch. Every rank builds the same standard-normal global batch
``(N, F)``, takes its ``N / W`` rows, and runs forward + backward of ``loss = sum of the outputs
of the first N/2 samples of the global batch``. Per implementation and cell: the largest
difference of outputs and input gradients from ``BatchNorm1d`` over the whole batch (local
BatchNorm is *expected* to differ: that is the point of SyncBN), the median forward+backward time
(slowest rank per repeat), bytes saved for backward (measured with autograd's saved-tensor hooks)
and peak RSS. Each cell also records ``tolerance``: how far float32 rounding alone may move those
differences (:func:`distlab.tools.verify.sum_tolerance` for the four means over a channel's ``N``
values that feed an output and an input gradient -- a sum's bound over ``N`` -- at the squared
input times the weight over the smallest standard deviation); a difference above it is a different
function, not rounding. torch's ``nn.SyncBatchNorm`` runs only on CUDA; on CPU it is recorded as not
available.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from distlab.bench.common import at_least, machine, write
from distlab.parallel import SyncBatchNorm
from distlab.launch.spawn import run_ranks
from distlab.tools.verify import sum_tolerance
from distlab.train.metrics import peak_rss_mb

IMPLEMENTATIONS = ("distlab", "local", "torch")


def _saved_bytes(fn) -> tuple[object, int]:
    """Run ``fn()`` and count the bytes autograd keeps for backward (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _build(impl: str, features: int, device: torch.device):
    if impl == "distlab":
        return SyncBatchNorm(features).to(device)
    if impl == "torch":
        return torch.nn.SyncBatchNorm(features).to(device)
    return torch.nn.BatchNorm1d(features).to(device)


def _bench(rank: int, world: int, features_list, batches, impls, warmup: int, repeats: int, device_name: str):
    device = torch.device(device_name)
    records = []
    for features in features_list:
        for batch in batches:
            g = torch.Generator().manual_seed(features * 1000 + batch)
            X = torch.randn(batch, features, generator=g).to(device).requires_grad_()
            ref = torch.nn.BatchNorm1d(features).to(device)
            Y = ref(X)
            Y[: batch // 2].sum().backward()
            std = X.detach().std(dim=0, unbiased=False).min().item()
            scale = max(1.0, X.detach().abs().max().item()) ** 2 * max(1.0, ref.weight.abs().max().item()) / min(1.0, std)
            tolerance = sum_tolerance(4 * batch, scale, X.dtype) / batch  # means over the batch, not sums
            per = batch // world
            lo = rank * per
            mask = (torch.arange(lo, lo + per, device=device) < batch // 2).float().unsqueeze(1)
            for impl in impls:
                if impl == "torch" and device.type != "cuda":
                    if rank == 0:
                        records.append({"implementation": impl, "workers": world, "features": features,
                                        "batch": batch, "available": False,
                                        "reason": "torch.nn.SyncBatchNorm runs only on CUDA tensors"})
                    continue
                bn = _build(impl, features, device)
                x = X.detach()[lo:lo + per].clone().requires_grad_()

                def step():
                    y = bn(x)
                    (y * mask).sum().backward()
                    return y

                y, saved = _saved_bytes(lambda: bn(x))
                (y * mask).sum().backward()
                out_err = (y.detach() - Y.detach()[lo:lo + per]).abs().max().item()
                grad_err = (x.grad - X.grad[lo:lo + per]).abs().max().item()
                for _ in range(warmup):
                    x.grad = None
                    step()
                times = []
                for _ in range(repeats):
                    x.grad = None
                    if world > 1:
                        dist.barrier()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                facts = torch.tensor([out_err, grad_err, saved, peak_rss_mb()], dtype=torch.float64)
                slowest = torch.tensor(times, dtype=torch.float64)
                if world > 1:
                    dist.all_reduce(facts, op=dist.ReduceOp.MAX)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if rank == 0:
                    records.append({
                        "implementation": impl, "workers": world, "features": features, "batch": batch,
                        "available": True, "device": device.type,
                        "max_abs_out_diff": facts[0].item(), "max_abs_grad_diff": facts[1].item(),
                        "tolerance": tolerance,
                        "time_s_median": statistics.median(slowest.tolist()),
                        "time_s_min": min(slowest.tolist()), "repeats": repeats,
                        "saved_for_backward_bytes": int(facts[2].item()), "peak_rss_mb": facts[3].item(),
                    })
    return records


def run(workers=(1, 2, 4), features=(128, 256, 512, 1024), batches=(32, 64), impls=IMPLEMENTATIONS,
        warmup: int = 5, repeats: int = 50, device: str = "cpu", out=None, progress=print) -> list[dict]:
    at_least(repeats=(repeats, 1), warmup=(warmup, 0))
    if min(batches) < 2 * max(workers):
        from distlab.errors import ConfigError
        raise ConfigError(f"batch normalisation needs two samples per worker at least: --batches {min(batches)} over "
                          f"{max(workers)} worker(s)")
    records = []
    for w in workers:
        bad = [b for b in batches if b % w]
        if bad:
            from distlab.errors import ConfigError
            raise ConfigError(f"global batch {bad[0]} does not split over {w} workers")
        progress(f"{w} worker(s): {len(features)} widths x {len(batches)} batches x {len(impls)} implementations ...")
        rows = run_ranks(_bench, w, list(features), list(batches), list(impls), warmup, repeats, device,
                         timeout=1800, threads=1, gpus=device != "cpu")[0]
        for r in rows:
            r.update(machine(w, 1))
        records += rows
    write(records, out, "syncbn")
    return records


def _sci(x) -> str:
    return "-" if x is None else f"{x:.1e}"  # results written before the bound was recorded have none


def table(records: list[dict]) -> str:
    rows = [f"{'workers':>7} {'features':>8} {'batch':>5} {'impl':<8} {'median ms':>9} {'vs local':>8} "
            f"{'out diff':>9} {'grad diff':>9} {'rounding':>9} {'saved KB':>8}"]
    local = {(r["workers"], r["features"], r["batch"]): r["time_s_median"] for r in records
             if r["implementation"] == "local" and r.get("available")}
    for r in records:
        key = (r["workers"], r["features"], r["batch"])
        if not r.get("available"):
            rows.append(f"{key[0]:>7} {key[1]:>8} {key[2]:>5} {r['implementation']:<8} not available: {r['reason']}")
            continue
        ratio = f"{r['time_s_median'] / local[key]:.2f}x" if key in local else "-"
        rows.append(f"{key[0]:>7} {key[1]:>8} {key[2]:>5} {r['implementation']:<8} {1000 * r['time_s_median']:>9.3f} "
                    f"{ratio:>8} {r['max_abs_out_diff']:>9.1e} {r['max_abs_grad_diff']:>9.1e} "
                    f"{_sci(r.get('tolerance')):>9} {r['saved_for_backward_bytes'] / 1024:>8.0f}")
    return "\n".join(rows)


def plot(records: list[dict], directory) -> list:
    """One PNG per worker count: forward+backward time vs features, per implementation and batch."""
    from pathlib import Path

    from distlab.tools.plots import pyplot, style
    plt = pyplot()

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    ok = [r for r in records if r.get("available")]
    for workers in sorted({r["workers"] for r in ok}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for impl in dict.fromkeys(r["implementation"] for r in ok):
            for batch in sorted({r["batch"] for r in ok}):
                pts = sorted((r["features"], 1000 * r["time_s_median"]) for r in ok
                             if r["workers"] == workers and r["implementation"] == impl and r["batch"] == batch)
                if pts:
                    ax.plot(*zip(*pts), label=f"{impl}, batch {batch}", **style(len(ax.lines)))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("features")
        ax.set_ylabel("forward+backward (ms)")
        ax.set_title(f"batch norm, {workers} worker(s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = directory / f"syncbn_w{workers}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
