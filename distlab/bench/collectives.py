"""``distlab bench collectives``: every algorithm against gloo's / NCCL's own, in one run.

For each world size, ``n`` real processes (one torch thread each) run every algorithm x op x size:
one checked call and ``warmup`` untimed calls each, then ``repeats`` rounds in which every
algorithm runs once (interleaved, so noise on a shared machine hits all alike), each call started
together after a barrier and timed as the slowest rank's time. Per record: median/min/max time, algorithm bandwidth
``S / t`` and bus bandwidth ``S / t * 2(n-1)/n`` (NCCL's convention: comparable across ``n``),
the error against a float64 reduction of every rank's input, bytes sent per rank (counted, or
analytic for native), and peak RSS. The same run measures the ceiling: raw TCP throughput over
loopback between two processes, and reports every bus bandwidth as a percentage of it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import comm
from distlab.bench.common import at_least, choose
from distlab.comm.ops import OPS
from distlab.runtime import cores as runtime_cores, free_port
from distlab.launch.spawn import run_ranks
from distlab.train.metrics import atomic_write_text, peak_rss_mb

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------- the ceiling


def _tcp_pair(rank: int, world: int, port: int, nbytes: int, rounds: int) -> float:
    """Rank 0 listens on ``port`` and drains; rank 1 sends ``rounds`` x ``nbytes`` and times it."""
    if rank == 0:
        with socket.create_server(("127.0.0.1", port)) as srv:
            srv.settimeout(30)
            conn, _ = srv.accept()
            with conn:
                view = memoryview(bytearray(1 << 20))
                left = nbytes * rounds
                while left > 0:
                    got = conn.recv_into(view[: min(len(view), left)])
                    if not got:
                        break
                    left -= got
                conn.sendall(b"k")
        return 0.0
    deadline = time.monotonic() + 30
    while True:  # until rank 0 listens
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    payload = bytes(nbytes)
    with s:
        t0 = time.perf_counter()
        for _ in range(rounds):
            s.sendall(payload)
        s.recv(1)
        return nbytes * rounds / (time.perf_counter() - t0) / 1e9


def tcp_loopback_gbps(nbytes: int = 4_000_000, rounds: int = 50) -> float:
    """One-way TCP throughput between two processes on 127.0.0.1, in GB/s (best of 3)."""
    return max(run_ranks(_tcp_pair, 2, free_port(), nbytes, rounds, init_group=False, timeout=120)[1]
               for _ in range(3))


# --------------------------------------------------------------------------- one world size


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17)
    return (2 * torch.rand(numel, generator=g, dtype=torch.float64) - 1).to(dtype)


def _reference(world: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    xs = torch.stack([_inputs(r, numel, dtype).double() for r in range(world)])
    return {"sum": xs.sum(0), "avg": xs.mean(0), "max": xs.max(0).values, "min": xs.min(0).values,
            "product": xs.prod(0)}[op]


def _bench_world(rank: int, world: int, algorithms, ops, sizes, dtypes, warmup: int, repeats: int) -> list[dict]:
    records = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for numel in sizes:
            source = _inputs(rank, numel, dtype)
            for op in ops:
                ref = _reference(world, numel, dtype, op) if rank == 0 else None
                t = source.clone()
                checked = {}
                for algo in algorithms:  # one checked call each (error, bytes), then the warm-up
                    t.copy_(source)
                    with comm.counting() as counted:
                        comm.all_reduce(t, op=op, algorithm=algo)
                    err = torch.zeros(2, dtype=torch.float64)
                    if rank == 0 and numel:
                        diff = (t.double() - ref).abs()
                        err = torch.tensor([diff.max().item(), diff.max().item() / max(ref.abs().max().item(), 1e-300)])
                    checked[algo] = (err, counted)
                    for _ in range(warmup):
                        t.copy_(source)
                        comm.all_reduce(t, op=op, algorithm=algo)
                # Interleaved: every repeat runs each algorithm once, so a slow spell on a shared
                # machine hits all of them alike instead of whichever happened to be running.
                times: dict[str, list[float]] = {algo: [] for algo in algorithms}
                for _ in range(repeats):
                    for algo in algorithms:
                        t.copy_(source)
                        dist.barrier()
                        t0 = time.perf_counter()
                        comm.all_reduce(t, op=op, algorithm=algo)
                        times[algo].append(time.perf_counter() - t0)
                for algo in algorithms:
                    err, counted = checked[algo]
                    # A collective is done when its slowest rank is: max over ranks, per repeat.
                    slowest = torch.tensor(times[algo], dtype=torch.float64)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    facts = torch.tensor([counted.bytes_sent, peak_rss_mb()], dtype=torch.float64)
                    dist.all_reduce(facts, op=dist.ReduceOp.MAX)
                    if rank == 0:
                        med = statistics.median(slowest.tolist())
                        nbytes = numel * source.element_size()
                        algbw = nbytes / med / 1e9 if med > 0 else 0.0
                        records.append({
                            "algorithm": algo, "op": op, "world_size": world, "numel": numel, "dtype": dtype_name,
                            "time_s_median": med, "time_s_min": min(slowest.tolist()),
                            "time_s_max": max(slowest.tolist()), "repeats": repeats,
                            "algbw_gbps": algbw, "busbw_gbps": algbw * (2 * (world - 1) / world if world > 1 else 0),
                            "max_abs_err": err[0].item(), "rel_err": err[1].item(),
                            "bytes_sent_per_rank": int(facts[0].item()), "bytes_analytic": counted.analytic,
                            "peak_rss_mb": facts[1].item(),
                        })
    return records


def _merge_runs(runs: list[list[dict]]) -> list[dict]:
    """Records of independent runs (same order) -> one record each: the median of the runs'
    medians (min of mins, max of maxes), bandwidths from that median, the worst error and RSS."""
    merged = []
    for same in zip(*runs):
        r = dict(same[0])
        per_run = [x["time_s_median"] for x in same]
        med = statistics.median(per_run)
        nbytes = r["algbw_gbps"] * r["time_s_median"] * 1e9
        algbw = nbytes / med / 1e9 if med > 0 else 0.0
        world = r["world_size"]
        r.update({"time_s_median": med, "time_s_median_per_run": per_run, "runs": len(same),
                  "time_s_min": min(x["time_s_min"] for x in same), "time_s_max": max(x["time_s_max"] for x in same),
                  "algbw_gbps": algbw, "busbw_gbps": algbw * (2 * (world - 1) / world if world > 1 else 0),
                  "max_abs_err": max(x["max_abs_err"] for x in same), "rel_err": max(x["rel_err"] for x in same),
                  "peak_rss_mb": max(x["peak_rss_mb"] for x in same)})
        merged.append(r)
    return merged


def check(worlds, algorithms, ops, dtypes, warmup: int, repeats: int, runs: int) -> list[str]:
    """Every argument of :func:`run`, before a process starts; the algorithms' canonical names."""
    at_least(repeats=(repeats, 1), runs=(runs, 1), warmup=(warmup, 0), world=(min(worlds, default=0), 1))
    choose("--ops", ops, OPS)
    choose("--dtypes", dtypes, DTYPES)
    return [comm.check_algorithm(a) for a in algorithms]


def run(worlds, sizes, algorithms, ops=("sum",), dtypes=("float32",), warmup: int = 3, repeats: int = 20,
        out: str | Path | None = None, progress=print, runs: int = 1) -> list[dict]:
    """Run the suite ``runs`` times (fresh processes each) and write ``out/collectives.json``:
    one record per configuration with the median over runs of each run's median time."""
    algorithms = check(worlds, algorithms, ops, dtypes, warmup, repeats, runs)
    cores = runtime_cores()
    ceiling = tcp_loopback_gbps()
    progress(f"ceiling: raw TCP over loopback, one way, 2 processes: {ceiling:.2f} GB/s")
    records = []
    for world in worlds:
        results = []
        for i in range(runs):
            progress(f"world size {world}: {len(algorithms)} algorithms x {len(ops)} ops x {len(sizes)} sizes"
                     + (f", run {i + 1} of {runs}" if runs > 1 else "") + " ...")
            results.append(run_ranks(_bench_world, world, algorithms, list(ops), list(sizes), list(dtypes), warmup,
                                     repeats, timeout=3600, threads=1)[0])
        merged = _merge_runs(results)
        for r in merged:
            r.update({"tcp_loopback_gbps": ceiling,
                      "busbw_pct_of_tcp": 100 * r["busbw_gbps"] / ceiling if ceiling else None,
                      "ranks": world, "cores": cores, "threads_per_rank": 1,
                      "oversubscribed": world > cores, "torch_version": torch.__version__,
                      "backend": "gloo", "host": platform.node(),
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        records += merged
    if out:
        atomic_write_text(Path(out) / "collectives.json", json.dumps(records, indent=1) + "\n")
    return records


def table(records: list[dict]) -> str:
    """A compact text table: time, bus bandwidth and its share of the TCP ceiling, error, bytes."""
    head = f"{'world':>5} {'numel':>9} {'algorithm':<15} {'op':<7} {'median ms':>10} {'busbw GB/s':>10} " \
           f"{'% tcp':>6} {'vs native':>9} {'max err':>9} {'bytes/rank':>11}"
    rows = [head]
    native = {(r["world_size"], r["numel"], r["op"], r["dtype"]): r["time_s_median"] for r in records
              if r["algorithm"] == "native"}
    for r in records:
        base = native.get((r["world_size"], r["numel"], r["op"], r["dtype"]))
        ratio = f"{r['time_s_median'] / base:.2f}x" if base else "-"
        pct = f"{r['busbw_pct_of_tcp']:.0f}" if r.get("busbw_pct_of_tcp") is not None else "-"
        rows.append(f"{r['world_size']:>5} {r['numel']:>9} {r['algorithm']:<15} {r['op']:<7} "
                    f"{1000 * r['time_s_median']:>10.3f} {r['busbw_gbps']:>10.3f} {pct:>6} {ratio:>9} "
                    f"{r['max_abs_err']:>9.1e} {r['bytes_sent_per_rank']:>11,}")
    return "\n".join(rows)


def crossovers(records: list[dict], latency: str = "butterfly", bandwidth: str = "ring") -> dict[int, int | None]:
    """Per world size: the smallest measured size from which ``bandwidth`` is faster than
    ``latency`` and stays so for every larger size (None: never, within the sizes measured)."""
    found = {}
    for world in sorted({r["world_size"] for r in records if r["world_size"] > 1}):
        t = {(r["algorithm"], r["numel"]): r["time_s_median"] for r in records
             if r["world_size"] == world and r["op"] == records[0]["op"] and r["dtype"] == records[0]["dtype"]}
        sizes = sorted({numel for (_, numel) in t if (latency, numel) in t and (bandwidth, numel) in t and numel})
        if not sizes:
            continue
        found[world] = None
        for i, numel in enumerate(sizes):
            if all(t[(bandwidth, s)] < t[(latency, s)] for s in sizes[i:]):
                found[world] = numel
                break
    return found


def fits(records: list[dict]) -> list[dict]:
    """The alpha-beta model of each algorithm's all-reduce on each world size, fitted to this bench's times
    (:func:`~distlab.plan.machine.fit_alpha_beta`: ``t = alpha x rounds + beta x bytes`` the busiest rank moves,
    least squares in relative error) -- what ``distlab plan calibrate`` fits too -- with its errors."""
    from distlab.plan.machine import fit_alpha_beta, rounds, volume
    out = []
    for world in sorted({r["world_size"] for r in records if r["world_size"] > 1}):
        for algo in dict.fromkeys(r["algorithm"] for r in records):
            points = [(rounds(algo, world), volume(algo, world, r["numel"] * _itemsize(r)), r["time_s_median"])
                      for r in records if r["world_size"] == world and r["algorithm"] == algo and r["numel"] > 0
                      and r["op"] in ("sum", "avg") and r["time_s_median"] > 0]
            if len({v for _, v, _ in points}) >= 2:  # two sizes at least: latency and bandwidth apart
                ab = fit_alpha_beta(points)
                out.append({"world_size": world, "algorithm": algo, **ab.to_dict()})
    return out


def fit_table(found: list[dict]) -> str:
    rows = [f"{'world':>5} {'algorithm':15} {'alpha us':>9} {'1/beta GB/s':>11} {'median err':>10} {'max err':>8}"]
    for f in found:
        bandwidth = f"{1e-9 / f['beta_s_per_byte']:.3f}" if f["beta_s_per_byte"] > 0 else "not measured"
        rows.append(f"{f['world_size']:>5} {f['algorithm']:15} {f['alpha_s'] * 1e6:>9.1f} {bandwidth:>11} "
                    f"{f['median_rel_err']:>9.0%} {f['max_rel_err']:>8.0%}")
    return "\n".join(rows)


FIT_KIND = "distlab-collectives-fit"


def write_fit(records: list[dict], out: str | Path) -> list[str]:
    """The fit of :func:`fits` written to OUT/collectives-fit.json; returns the lines to print (none where no
    algorithm was measured at two sizes)."""
    from distlab.bench.common import busy_bench
    from distlab.train.metrics import atomic_write_text
    found = fits(records)
    if not found:
        return []
    busy = busy_bench(records)
    path = Path(out) / "collectives-fit.json"
    atomic_write_text(path, json.dumps({"kind": FIT_KIND, "fits": found, "busy": busy}, indent=1) + "\n")
    return ["alpha-beta fit of each all-reduce, t = alpha x message rounds + beta x bytes the busiest rank moves"
            + (" (the machine was busy: this run's fit only)" if busy else "") + ":", fit_table(found),
            f"wrote {path}"]


def fit_markdown(data: dict) -> str:
    """OUT/collectives-fit.json as a Markdown table (``distlab bench markdown``)."""
    rows = ["| world | algorithm | alpha (us a round) | 1/beta (GB/s) | median / max error |", "|---|---|---|---|---|"]
    for f in data["fits"]:
        bandwidth = f"{1e-9 / f['beta_s_per_byte']:.2f}" if f["beta_s_per_byte"] > 0 else "not measured"
        rows.append(f"| {f['world_size']} | {f['algorithm']} | {f['alpha_s'] * 1e6:.1f} | {bandwidth} | "
                    f"{f['median_rel_err']:.0%} / {f['max_rel_err']:.0%} |")
    return "\n".join(rows) + (f"\n\n(the machine was busy: {data['busy']})" if data.get("busy") else "")


def _itemsize(record: dict) -> int:
    return torch.empty(0, dtype=getattr(torch, record.get("dtype", "float32"))).element_size()


def plot(records: list[dict], directory: str | Path) -> list[Path]:
    """Time-vs-size and busbw-vs-size PNGs, one pair per world size."""
    from distlab.tools.plots import pyplot, style
    plt = pyplot()

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for world in sorted({r["world_size"] for r in records}):
        for key, label, fname in (("time_s_median", "median time (s)", "time"),
                                  ("busbw_gbps", "bus bandwidth (GB/s)", "busbw")):
            fig, ax = plt.subplots(figsize=(6, 4))
            for algo in dict.fromkeys(r["algorithm"] for r in records):
                pts = sorted((r["numel"], r[key]) for r in records
                             if r["world_size"] == world and r["algorithm"] == algo and r["op"] == records[0]["op"]
                             and r["numel"] > 0)
                if pts:
                    ax.plot(*zip(*pts), label=algo, **style(len(ax.lines)))
            ax.set_xscale("log")
            ax.set_yscale("log" if key == "time_s_median" else "linear")
            ax.set_xlabel("elements (float32)")
            ax.set_ylabel(label)
            ax.set_title(f"all-reduce, world size {world}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            path = directory / f"collectives_{fname}_w{world}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    written += _plot_fits(records, directory, plt)
    return written


def _plot_fits(records: list[dict], directory: Path, plt) -> list[Path]:
    """Per world size: each algorithm's measured times (points) against its fitted alpha-beta line."""
    from distlab.plan.machine import rounds, volume
    written = []
    found = fits(records)
    for world in sorted({f["world_size"] for f in found}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for k, f in enumerate(f for f in found if f["world_size"] == world):
            algo, color = f["algorithm"], f"C{k}"
            pts = sorted((r["numel"], r["time_s_median"], _itemsize(r)) for r in records if r["world_size"] == world
                         and r["algorithm"] == algo and r["numel"] > 0 and r["op"] in ("sum", "avg"))
            ax.plot([n for n, _, _ in pts], [t for _, t, _ in pts], "o", color=color, label=f"{algo} measured")
            ax.plot([n for n, _, _ in pts], [f["alpha_s"] * rounds(algo, world) + f["beta_s_per_byte"]
                                             * volume(algo, world, n * e) for n, _, e in pts], "-",
                    color=color, label=f"{algo} alpha-beta")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("elements (float32)")
        ax.set_ylabel("all-reduce time (s)")
        ax.set_title(f"measured vs the alpha-beta fit, world size {world}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        path = directory / f"collectives_fit_w{world}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def run_here(rank: int, world: int, sizes, algorithms, ops=("sum",), dtypes=("float32",), warmup: int = 3,
             repeats: int = 20, runs: int = 1, out: str | Path | None = None, link: str | None = None,
             burst: str | None = None) -> list[dict] | None:
    """The suite on the process group this process already belongs to -- one rank per node of a real
    or emulated cluster (``distlab cluster run -- distlab bench collectives --nproc-per-node 1
    --link 1gbit``), so messages cross the nodes' links instead of loopback. ``runs`` repeats run in
    the same processes. Rank 0 writes ``out/collectives.json`` (records name the ``link``) and
    returns the records; other ranks return None."""
    torch.set_num_threads(1)
    algorithms = check([world], algorithms, ops, dtypes, warmup, repeats, runs)
    results = [_bench_world(rank, world, algorithms, list(ops), list(sizes), list(dtypes), warmup, repeats)
               for _ in range(runs)]
    if rank != 0:
        return None
    records = _merge_runs(results)
    for r in records:
        r.update({"link": link, "burst": burst, "ranks": world, "cores": os.cpu_count(), "threads_per_rank": 1,
                  "oversubscribed": world > (os.cpu_count() or 1), "torch_version": torch.__version__,
                  "backend": dist.get_backend(), "host": platform.node(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    if out:
        atomic_write_text(Path(out) / "collectives.json", json.dumps(records, indent=1) + "\n")
    return records
