"""``distlab bench parallel``: model-state parallelism side by side with torch's built-ins.

Every configuration trains the same model from the same seed on the same batches with Adam (or
``--optimizer sgd``: SGD with momentum 0.9, whose runs agree within distlab.tools.verify's bound) for
``--steps`` steps on ``--nproc`` gloo processes:

distlab (through :class:`~distlab.train.Trainer`): ``dp`` (all-reduce), ``zero1``, ``zero2``,
``zero3``, ``tp-naive`` and ``tp-megatron`` (tp = nproc), ``dp2xtp`` (Megatron, tp=2), and on the
transformer ``tp-sp`` (tp = nproc with sequence parallel).

torch: ``torch-zero1`` (DDP + ``ZeroRedundancyOptimizer``), ``torch-fsdp2`` (``fully_shard`` on
every Linear and the root), ``torch-tp`` (``torch.distributed.tensor.parallel``: colwise/rowwise
on the MLP block; on the transformer the plan torchtitan uses -- q, k, v and the first MLP layer
colwise, the output projection and second MLP layer rowwise, the token embedding rowwise over the
vocabulary, the LM head colwise with ``loss_parallel``), ``torch-tp-sp`` (that plan with
``SequenceParallel`` LayerNorms, inputs gathered with ``PrepareModuleInput`` and outputs
reduce-scattered). One that does not run here is recorded with its error as "not supported".

Workloads: ``mlp`` and ``wide-mlp`` on ``--dataset``; ``gpt`` (the default GPT: 2 blocks, width
128, context 64) on ``--text-dataset``. Sequence parallel runs on the transformer only.

Per run: median time per step (first steps excluded), bytes sent per rank per step (distlab's
accounting; for torch's, the textbook volume of what they send, marked ``comm_bytes_basis``),
bytes of parameters + gradients + optimizer state per rank (distlab: the peak; torch: after a
step, local shards only), peak RSS, and the training loss averaged over all steps and ranks (the
same for every strategy up to rounding: they all train the same model on the same batches).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from distlab.bench.common import at_least, choose, cores, format_table, machine, train_on_ranks, write
from distlab.errors import ConfigError
from distlab.parallel import Strategy
from distlab.parallel.state_bytes import model_state_bytes
from distlab.launch.spawn import run_ranks
from distlab.train.config import TrainConfig

WORKLOADS = {"mlp": (512, 256), "wide-mlp": (4096, 4096), "gpt": None}
TEXT_WORKLOADS = ("gpt",)
# Short names for the usual set; any Strategy text works too. N is replaced by --nproc.
ALIASES = {"dp": "allreduce", "zero1": "zero=1", "zero2": "zero=2", "zero3": "zero=3",
           "tp-naive": "allreduce+tp=N+naive", "tp-megatron": "allreduce+tp=N", "dp2xtp": "allreduce+tp=2",
           "tp-sp": "allreduce+tp=N+sp"}
TORCH = ("torch-zero1", "torch-fsdp2", "torch-tp", "torch-tp-sp")
STRATEGIES = tuple(ALIASES) + TORCH
# distlab's strategy -> torch's counterpart it is compared with (ZeRO-2 too: torch has no ZeRO-2
# of its own for a plain model but ZeroRedundancyOptimizer + DDP moves the same bytes)
COUNTERPART = {"zero1": "torch-zero1", "zero2": "torch-zero1", "zero3": "torch-fsdp2", "tp-megatron": "torch-tp",
               "tp-sp": "torch-tp-sp"}
TEXT_ONLY = ("tp-sp", "torch-tp-sp")  # sequence parallel splits a transformer's sequence


def applies(workload: str, strategy: str) -> bool:
    """Whether ``strategy`` runs on ``workload`` (sequence parallel needs a sequence)."""
    sp = strategy in TEXT_ONLY or (strategy not in TORCH and "+sp" in ALIASES.get(strategy, strategy))
    return workload in TEXT_WORKLOADS or not sp


def strategy_for(name: str, nproc: int) -> Strategy:
    """A distlab strategy by alias or text form, checked against ``nproc`` processes."""
    return Strategy.parse(ALIASES.get(name, name).replace("=N", f"={nproc}")).check(nproc)


OPTIMIZERS = {"adam": 1e-3, "sgd": 0.05}  # optimizer -> learning rate (SGD with momentum 0.9)


def config(strategy: Strategy, widths, steps: int, batch: int, dataset: str, optimizer: str = "adam") -> TrainConfig:
    """The run of one cell: the MLP of ``widths``, or (``widths`` None) the default GPT."""
    model = "gpt" if widths is None else "mlp"
    sizes = {"mlp_widths": tuple(widths)} if widths else {}
    return TrainConfig.from_flags(model=model, **sizes, dataset=dataset, epochs=1000, max_steps=steps,
                       global_batch_size=batch, optimizer=optimizer, lr=OPTIMIZERS[optimizer], momentum=0.9,
                       lr_schedule="constant", seed=0,
                       log_every=steps, progress=False, verbose=False, eval_every_epoch=False,
                       timing_warmup_steps=min(5, steps // 3), strategy=strategy)


def _torch(rank: int, world: int, kind: str, cfg: TrainConfig) -> dict | None:
    """torch's own implementation of a strategy, in a plain training loop over the same batches."""
    import torch.distributed as dist

    from distlab.data.loader import TrainLoader
    from distlab.models import build_model, task_loss
    from distlab.train.metrics import median_excluding_warmup, peak_rss_mb

    data = cfg.load("train")
    device = torch.device("cpu")  # distlab's side: gloo ranks on the CPU (runtime.from_process_group)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options())
    params = sum(p.numel() for p in model.parameters())
    n, dp = world, world
    scoring = contextlib.nullcontext  # where the loss is computed and differentiated
    kind_of_opt, opt_args = ((torch.optim.Adam, {"lr": cfg.lr}) if cfg.optimizer == "adam" else
                             (torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum}))
    if kind == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kind_of_opt, **opt_args)
        sent = 3 * (n - 1) * params * 4 // n  # gradient all-reduce + every shard broadcast to the others
    elif kind == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (world,))  # the run's device, not torch's default (cuda if present)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = kind_of_opt(model.parameters(), **opt_args)
        sent = 3 * (n - 1) * params * 4 // n  # all-gather forward, all-gather backward, reduce-scatter
    elif kind in ("torch-tp", "torch-tp-sp") and cfg.model == "gpt":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
        sp = kind == "torch-tp-sp"
        parallelize_module(model, init_device_mesh(device.type, (world,)), gpt_tp_plan(len(model), sp))
        opt = kind_of_opt(model.parameters(), **opt_args)
        dp, scoring = 1, loss_parallel
        sent = gpt_tp_bytes(cfg, n, sp)
    elif kind == "torch-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh(device.type, (world,))
        first, second = [str(i) for i, m in enumerate(model.net) if isinstance(m, torch.nn.Linear)][:2]
        parallelize_module(model.net, mesh, {first: ColwiseParallel(), second: RowwiseParallel()})
        opt = kind_of_opt(model.parameters(), **opt_args)
        dp = 1
        # The block's output is all-reduced forward; backward has nothing to reduce, since the
        # block's input (the images) needs no gradient -- distlab's Megatron layers count the same.
        act = cfg.global_batch_size * cfg.options.mlp_widths[1] * 4
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
        with scoring():  # torch's vocabulary-parallel cross-entropy needs both inside loss_parallel
            loss = task_loss(model(x), y)
            loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()))
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


def gpt_tp_plan(n_layers: int, sp: bool) -> dict:
    """torch's tensor-parallel plan of distlab's GPT (embedding, blocks 1..n-2, head), as torchtitan
    writes it for Llama: attention and MLP colwise then rowwise, vocabulary-parallel embedding and
    head (with ``loss_parallel``); ``sp``: LayerNorms on sequence shards, the attention and MLP
    inputs all-gathered along the sequence and their outputs reduce-scattered back to it. The
    embedding adds the position table inside one module, so its output is split along the sequence
    after the sum (a local slice)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)
    out = Shard(1) if sp else Replicate()
    plan = {"0.tok": RowwiseParallel(input_layouts=Replicate())}
    if sp:
        plan["0"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    for i in range(1, n_layers - 1):
        plan.update({f"{i}.attn.q": ColwiseParallel(), f"{i}.attn.k": ColwiseParallel(),
                     f"{i}.attn.v": ColwiseParallel(), f"{i}.attn.proj": RowwiseParallel(output_layouts=out),
                     f"{i}.mlp.0": ColwiseParallel(), f"{i}.mlp.2": RowwiseParallel(output_layouts=out)})
        if sp:
            plan.update({f"{i}.ln1": SequenceParallel(), f"{i}.ln2": SequenceParallel(),
                         f"{i}.attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                         f"{i}.mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())})
    if sp:
        plan[f"{n_layers - 1}.ln"] = SequenceParallel()
    plan[f"{n_layers - 1}.out"] = ColwiseParallel(input_layouts=out, output_layouts=Shard(-1), use_local_output=False)
    return plan


def gpt_tp_bytes(cfg: TrainConfig, n: int, sp: bool) -> int:
    """Textbook bytes one rank sends per step under :func:`gpt_tp_plan` (float32 activations of
    ``a = batch x context x width``): the embedding's all-reduce; per block, two collectives
    forward and two backward (all-reduces; with ``sp`` each an all-gather plus a reduce-scatter,
    half the bytes apiece); the head's input (all-reduce of its gradient, or all-gather forward and
    reduce-scatter backward); the parallel cross-entropy's three numbers per token."""
    a = cfg.global_batch_size * cfg.block_size * cfg.options.n_embd * 4
    allreduce, half = 2 * (n - 1) * a // n, (n - 1) * a // n
    per_block = 4 * 2 * half if sp else 4 * allreduce
    head = 2 * half if sp else allreduce
    tokens = cfg.global_batch_size * cfg.block_size
    return allreduce + cfg.options.n_layer * per_block + head + 3 * 2 * (n - 1) * tokens * 4 // n


def run(workloads=("mlp", "wide-mlp", "gpt"), strategies=STRATEGIES, nproc: int = 4, steps: int = 20, batch: int = 64,
        dataset: str = "fashion-mnist", data_dir: str | None = None, out=None, progress=print,
        text_dataset: str = "fortunes", runs: int = 1, optimizer: str = "adam") -> list[dict]:
    """Every (workload, strategy) cell, ``runs`` interleaved rounds of each: a record per cell with
    the median step time over the rounds and, where torch has the counterpart, the ratio of the
    medians with the range of the rounds' ratios."""
    workloads = choose("--workloads", workloads, WORKLOADS)
    optimizer, = choose("--optimizer", [optimizer], OPTIMIZERS)
    at_least(nproc=(nproc, 2), steps=(steps, 3), runs=(runs, 1))
    if nproc % 2:
        raise ConfigError(f"--nproc {nproc}: tensor parallel pairs ranks, use an even number")
    for name in workloads:  # every flag and the batch split, before a process starts
        for s in strategies:
            if s not in TORCH and applies(name, s):
                data = text_dataset if name in TEXT_WORKLOADS else dataset
                config(strategy_for(s, nproc), WORKLOADS[name], steps, batch, data, optimizer).validate(nproc)
    threads = max(1, cores() // nproc)
    cells: dict[tuple[str, str], dict] = {}
    for round_ in range(runs):
        for name in workloads:
            widths = WORKLOADS[name]
            data = text_dataset if name in TEXT_WORKLOADS else dataset
            for strategy in strategies:
                if not applies(name, strategy) or cells.get((name, strategy), {}).get("supported") is False:
                    continue
                progress(f"{name}: {strategy} on {nproc} processes" + (f" (round {round_ + 1} of {runs})"
                                                                        if runs > 1 else ""))
                cfg = config(Strategy() if strategy in TORCH else strategy_for(strategy, nproc), widths, steps,
                             batch, data, optimizer)
                cfg.data_dir = data_dir
                base = {"workload": name, "mlp_widths": list(widths) if widths else None, "model": cfg.model,
                        "strategy": strategy, "world_size": nproc,
                        "strategy_text": None if strategy in TORCH else str(cfg.strategy),
                        "implementation": "torch" if strategy in TORCH else "distlab", "global_batch_size": batch,
                        "steps": steps, "optimizer": optimizer, "dataset": data, **machine(nproc, threads)}
                try:
                    if strategy in TORCH:
                        s = run_ranks(_torch, nproc, strategy, cfg, timeout=1800, threads=threads)[0]
                    else:
                        s = run_ranks(train_on_ranks, nproc, cfg, timeout=1800, threads=threads)[0]
                except Exception as exc:  # a torch built-in that does not run on CPU/gloo here
                    first = str(exc).strip().splitlines()
                    cells[name, strategy] = {**base, "supported": False, "error": next(
                        (ln for ln in reversed(first) if "Error" in ln), first[-1] if first else type(exc).__name__)[:400]}
                    progress(f"  not supported: {cells[name, strategy]['error']}")
                    continue
                cell = cells.setdefault((name, strategy), {
                    **base, "supported": True, "time_per_step_s_runs": [],
                    "comm_bytes_per_step": s["comm_bytes_per_step"],
                    "comm_bytes_basis": s.get("comm_bytes_basis", "counted by distlab.comm"),
                    "model_state_bytes_per_rank": s["model_state_bytes_per_rank"],
                    "model_state_basis": s.get("model_state_basis", "peak during the step"),
                    "peak_rss_mb": s["peak_rss_mb"], "final_train_loss": s["final_train_loss"]})
                cell["time_per_step_s_runs"].append(s["time_per_step_s_median"])
    records = list(cells.values())
    for r in records:
        if r["supported"]:
            r["time_per_step_s_median"] = statistics.median(r["time_per_step_s_runs"])
    for r in records:
        theirs = COUNTERPART.get(r["strategy"])
        other = cells.get((r["workload"], theirs)) if theirs else None
        if r["supported"] and other and other["supported"]:
            ratios = [a / b for a, b in zip(r["time_per_step_s_runs"], other["time_per_step_s_runs"])]
            r.update(vs_torch=r["time_per_step_s_median"] / other["time_per_step_s_median"],
                     vs_torch_range=[min(ratios), max(ratios)])
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
        theirs = COUNTERPART.get(r["strategy"])
        other = by.get((r["workload"], theirs)) if theirs else None
        ratio = (f"{r['time_per_step_s_median'] / other['time_per_step_s_median']:.2f}x" if other and other.get("supported")
                 else "-")
        if r.get("vs_torch_range") and len(r.get("time_per_step_s_runs", [])) > 1:
            ratio += f" ({r['vs_torch_range'][0]:.2f}-{r['vs_torch_range'][1]:.2f})"
        rows.append([r["workload"], r["strategy"], f"{1000 * r['time_per_step_s_median']:.1f}", ratio,
                     f"{r['comm_bytes_per_step'] / 2**20:.2f}", f"{r['model_state_bytes_per_rank'] / 2**20:.2f}",
                     f"{r['peak_rss_mb']:.0f}", f"{r['final_train_loss']:.4f}"])
    return format_table(["workload", "strategy", "ms/step", "vs torch", "MiB sent/step", "state MiB/rank",
                         "peak RSS MB", "loss"], rows, markdown)
