"""``distlab bench parallel``: model-state parallelism side by side with torch's built-ins.

Every configuration trains the same model from the same seed on the same batches with Adam for
``--steps`` steps on ``--nproc`` gloo processes:

distlab (through :class:`~distlab.train.Trainer`): ``dp`` (all-reduce), ``zero1``, ``zero2``,
``zero3``, ``tp-naive`` and ``tp-megatron`` (tp = nproc), ``dp2xtp`` (Megatron, tp=2).

torch: ``torch-zero1`` (DDP + ``ZeroRedundancyOptimizer``), ``torch-fsdp2`` (``fully_shard`` on
every Linear and the root), ``torch-tp`` (``torch.distributed.tensor.parallel`` colwise/rowwise
on the MLP block). One that does not run here is recorded with its error as "not supported".

Per run: median time per step (first steps excluded), bytes sent per rank per step (distlab's
accounting; for torch's, the textbook volume of what they send, marked ``comm_bytes_basis``),
bytes of parameters + gradients + optimizer state per rank (distlab: the peak; torch: after a
step, local shards only), peak RSS, and the training loss averaged over all steps and ranks (the
same for every strategy up to rounding: they all train the same model on the same batches).
"""

from __future__ import annotations

import time

import torch

from distlab.bench.common import at_least, choose, cores, format_table, machine, train_on_ranks, write
from distlab.errors import ConfigError
from distlab.parallel import Strategy
from distlab.parallel.state_bytes import model_state_bytes
from distlab.spawn import run_ranks
from distlab.train.config import TrainConfig

WORKLOADS = {"mlp": (512, 256), "wide-mlp": (4096, 4096)}
# Short names for the usual set; any Strategy text works too. N is replaced by --nproc.
ALIASES = {"dp": "allreduce", "zero1": "zero=1", "zero2": "zero=2", "zero3": "zero=3",
           "tp-naive": "allreduce+tp=N+naive", "tp-megatron": "allreduce+tp=N", "dp2xtp": "allreduce+tp=2"}
TORCH = ("torch-zero1", "torch-fsdp2", "torch-tp")
STRATEGIES = tuple(ALIASES) + TORCH
COUNTERPART = {"torch-zero1": "zero1", "torch-fsdp2": "zero3", "torch-tp": "tp-megatron"}


def strategy_for(name: str, nproc: int) -> Strategy:
    """A distlab strategy by alias or text form, checked against ``nproc`` processes."""
    return Strategy.parse(ALIASES.get(name, name).replace("=N", f"={nproc}")).check(nproc)


def config(strategy: Strategy, widths, steps: int, batch: int, dataset: str) -> TrainConfig:
    return TrainConfig(model="mlp", mlp_widths=tuple(widths), dataset=dataset, epochs=1000, max_steps=steps,
                       global_batch_size=batch, optimizer="adam", lr=1e-3, lr_schedule="constant", seed=0,
                       log_every=steps, progress=False, verbose=False, eval_every_epoch=False,
                       timing_warmup_steps=min(5, steps // 3), strategy=strategy)


def _torch(rank: int, world: int, kind: str, cfg: TrainConfig) -> dict | None:
    """torch's own implementation of a strategy, in a plain training loop over the same batches."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from distlab.data import load_dataset
    from distlab.data.loader import TrainLoader
    from distlab.models import build_model
    from distlab.train.metrics import median_excluding_warmup, peak_rss_mb

    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model("mlp", data.input_shape, data.num_classes, widths=cfg.mlp_widths)
    params = sum(p.numel() for p in model.parameters())
    n, dp = world, world
    if kind == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr)
        sent = 3 * (n - 1) * params * 4 // n  # gradient all-reduce + every shard broadcast to the others
    elif kind == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        sent = 3 * (n - 1) * params * 4 // n  # all-gather forward, all-gather backward, reduce-scatter
    elif kind == "torch-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world,))
        first, second = [str(i) for i, m in enumerate(model.net) if isinstance(m, torch.nn.Linear)][:2]
        parallelize_module(model.net, mesh, {first: ColwiseParallel(), second: RowwiseParallel()})
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        dp = 1
        # The block's output is all-reduced forward; backward has nothing to reduce, since the
        # block's input (the images) needs no gradient -- distlab's Megatron layers count the same.
        act = cfg.global_batch_size * cfg.mlp_widths[1] * 4
        sent = 2 * (n - 1) * act // n
    else:
        raise ValueError(kind)
    loader = TrainLoader(data, rank=rank if dp > 1 else 0, world_size=dp, local_batch=cfg.global_batch_size // dp,
                         shuffle=True, seed=cfg.seed)
    times, losses, state = [], [], 0
    batches = iter(loader)
    for step in range(cfg.max_steps):
        x, y = next(batches)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step == 0:
            state = model_state_bytes(model, opt)
    t = torch.tensor([peak_rss_mb(), state], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mean_loss = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)  # as the trainer logs it
    dist.all_reduce(mean_loss)
    if rank:
        return None
    return {"time_per_step_s_median": median_excluding_warmup(times, cfg.timing_warmup_steps),
            "final_train_loss": mean_loss.item() / world, "peak_rss_mb": t[0].item(),
            "model_state_bytes_per_rank": int(t[1].item()), "comm_bytes_per_step": sent,
            "comm_bytes_basis": "textbook volume of torch's collectives",
            "model_state_basis": "after the first step, local shards (not the in-step peak)"}


def run(workloads=("mlp", "wide-mlp"), strategies=STRATEGIES, nproc: int = 4, steps: int = 20, batch: int = 64,
        dataset: str = "fashion-mnist", data_dir: str | None = None, out=None, progress=print) -> list[dict]:
    workloads = choose("--workloads", workloads, WORKLOADS)
    at_least(nproc=(nproc, 2), steps=(steps, 3))
    if nproc % 2:
        raise ConfigError(f"--nproc {nproc}: tensor parallel pairs ranks, use an even number")
    for s in strategies:  # every flag and the batch split, before a process starts
        if s not in TORCH:
            config(strategy_for(s, nproc), WORKLOADS[workloads[0]], steps, batch, dataset).validate(nproc)
    threads = max(1, cores() // nproc)
    records = []
    for name in workloads:
        widths = WORKLOADS[name]
        for strategy in strategies:
            progress(f"{name}: {strategy} on {nproc} processes")
            cfg = config(Strategy() if strategy in TORCH else strategy_for(strategy, nproc), widths, steps, batch,
                         dataset)
            cfg.data_dir = data_dir
            base = {"workload": name, "mlp_widths": list(widths), "strategy": strategy, "world_size": nproc,
                    "strategy_text": None if strategy in TORCH else str(cfg.strategy),
                    "implementation": "torch" if strategy in TORCH else "distlab", "global_batch_size": batch,
                    "steps": steps, "optimizer": "adam", "dataset": dataset, **machine(nproc, threads)}
            try:
                if strategy in TORCH:
                    s = run_ranks(_torch, nproc, strategy, cfg, timeout=1800, threads=threads)[0]
                else:
                    s = run_ranks(train_on_ranks, nproc, cfg, timeout=1800, threads=threads)[0]
            except Exception as exc:  # a torch built-in that does not run on CPU/gloo here
                first = str(exc).strip().splitlines()
                records.append({**base, "supported": False,
                                "error": next((ln for ln in reversed(first) if "Error" in ln), first[-1] if first
                                              else type(exc).__name__)[:400]})
                progress(f"  not supported: {records[-1]['error']}")
                continue
            records.append({**base, "supported": True, "time_per_step_s_median": s["time_per_step_s_median"],
                            "comm_bytes_per_step": s["comm_bytes_per_step"],
                            "comm_bytes_basis": s.get("comm_bytes_basis", "counted by distlab.comm"),
                            "model_state_bytes_per_rank": s["model_state_bytes_per_rank"],
                            "model_state_basis": s.get("model_state_basis", "peak during the step"),
                            "peak_rss_mb": s["peak_rss_mb"], "final_train_loss": s["final_train_loss"]})
    write(records, out, "parallel")
    return records


def table(records: list[dict], markdown: bool = False) -> str:
    """One row per run: time per step (and against torch's counterpart), bytes sent, model state, memory, loss."""
    by = {(r["workload"], r["strategy"]): r for r in records}
    rows = []
    for r in records:
        if not r.get("supported"):
            rows.append([r["workload"], r["strategy"], "not supported: " + str(r.get("error", ""))[:60], *["-"] * 5])
            continue
        theirs = next((t for t, d in COUNTERPART.items() if d == r["strategy"]), None)
        other = by.get((r["workload"], theirs)) if theirs else None
        ratio = (f"{r['time_per_step_s_median'] / other['time_per_step_s_median']:.2f}x"
                 if other and other.get("supported") else "-")
        rows.append([r["workload"], r["strategy"], f"{1000 * r['time_per_step_s_median']:.1f}", ratio,
                     f"{r['comm_bytes_per_step'] / 2**20:.2f}", f"{r['model_state_bytes_per_rank'] / 2**20:.2f}",
                     f"{r['peak_rss_mb']:.0f}", f"{r['final_train_loss']:.4f}"])
    return format_table(["workload", "strategy", "ms/step", "vs torch", "MiB sent/step", "state MiB/rank",
                         "peak RSS MB", "loss"], rows, markdown)
