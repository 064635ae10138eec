"""``distlab bench overhead``: distlab's single-process step beside a plain PyTorch loop.

The same model, data, optimizer, precision and device, trained for ``--steps`` steps per side in
interleaved rounds (plain, distlab, plain, distlab, ...: slow drift of the machine hits both
alike), each side in a fresh process. The sides:

* ``plain`` -- the loop a PyTorch user writes: ``torch.utils.data.DataLoader`` over the normalised
  training set (shuffled, ``drop_last``), each batch copied to the device (``non_blocking``),
  ``torch.autocast`` for bf16/fp16 and ``torch.amp.GradScaler`` for fp16;
* ``plain-resident`` (GPU runs only) -- the same loop with the data already in GPU memory, a batch
  gathered there by a shuffled permutation: the fastest plain loop;
* ``distlab`` -- ``distlab train``'s :class:`~distlab.train.Trainer` on one process
  (``data_on_device`` auto: resident on a GPU when the data fits);
* with ``--compile``, also ``plain-compiled`` -- the plain loop with the whole model through
  ``torch.compile`` (nanoGPT's way: the strongest plain baseline) -- and ``distlab-compiled``
  (``distlab train --compile``: each block compiled); the table then gives distlab-compiled /
  plain-compiled and the compiler's speed-up of distlab's step (distlab / distlab-compiled).

Both sides build the same optimizer (:func:`~distlab.train.optim.build_optimizer`: torch's fused kernel
on a GPU). A step is timed from taking its batch to taking the next one: on a CPU by the host clock, on
a GPU by CUDA events recorded as each step starts (:class:`~distlab.train.clock.StepClock`, on both
sides: no side waits for the device per step), first steps excluded (compilation happens in the
first); a side's time is its median step. Per round the ratio distlab / plain
is taken; the table gives the median ratio of the rounds and their range.
"""

from __future__ import annotations

import dataclasses

import torch

from distlab.bench.common import at_least, choose, format_table, machine, write
from distlab.train.config import TrainConfig
from distlab.tools.overhead_summary import figure, summarize

WORKLOADS = {"mlp": dict(model="mlp", mlp_widths=(512, 256), dataset="fashion-mnist", global_batch_size=64),
             "gpt": dict(model="gpt", dataset="synthetic-text", global_batch_size=32),
             # compute ~0 (16-8-2, batch 8): what is left of a step is the framework's own cost
             "tiny": dict(model="mlp", mlp_widths=(8,), dataset="synthetic:1x4x4:2:8192", global_batch_size=8),
             # a GPU's workload: GPT-2 small's shape on bytes (86 M parameters), AdamW as LLM trainers run it
             "gpt-12x768": dict(model="gpt", n_layer=12, n_head=12, n_embd=768, block_size=1024,
                                dataset="synthetic-text:4000000", global_batch_size=16, optimizer="adamw", lr=3e-4,
                                weight_decay=0.1),
             "llama": dict(model="llama", dataset="synthetic-text", global_batch_size=32),
             # a GPU's: Llama 3.2 1B's body on bytes (16 x 2048, 32 heads / 8 key-value, SwiGLU 8192; 0.97 B
             # parameters), 2048 tokens, batch 4 (an 80 GB GPU holds its activations eager too), AdamW
             "llama-1b": dict(model="llama", n_layer=16, n_head=32, kv_heads=8, n_embd=2048, ffn_hidden=8192,
                              rope_theta=500000.0, block_size=2048, dataset="synthetic-text:4000000",
                              global_batch_size=4, optimizer="adamw", lr=3e-4, weight_decay=0.1)}
PRECISIONS = ("fp32", "bf16", "fp16")


def config(workload: str, precision: str, steps: int, dataset: str | None, data_dir: str | None) -> TrainConfig:
    settings = {"lr": 0.01, "optimizer": "sgd", "momentum": 0.9, **WORKLOADS[workload],
                **({"dataset": dataset} if dataset else {})}
    return TrainConfig.from_flags(**settings, data_dir=data_dir, epochs=1000, max_steps=steps,
                                  lr_schedule="constant", seed=0, log_every=steps,
                                  progress=False, verbose=False, eval_every_epoch=False,
                                  timing_warmup_steps=min(10, steps // 4), precision=precision,
                                  eval_batch_size=WORKLOADS[workload]["global_batch_size"], eval_batches=1)


def _plain(rank: int, world: int, cfg: TrainConfig, device_name: str, resident: bool, compiled: bool = False) -> dict:
    """The plain loop: one process, no distlab in the step (``compiled``: the model through torch.compile)."""
    from distlab.models import build_model, task_loss
    from distlab.train.clock import StepClock
    from distlab.train.metrics import median_excluding_warmup
    from distlab.train.optim import build_optimizer, decay_groups, no_decay_names
    from distlab.train.summary import StepTimes

    device = torch.device(device_name)
    data = cfg.load("train")
    x_all, y_all = data.batch(torch.arange(len(data)))  # normalised once, as a Dataset's transform would
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options()).to(device)
    if compiled:
        model.compile()
    no_decay = no_decay_names(model) if decay_groups(cfg) else set()
    opt = build_optimizer(model.parameters(), cfg, [n for n, _ in model.named_parameters()], no_decay)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.strategy.precision)
    scaler = torch.amp.GradScaler(device.type) if cfg.strategy.precision == "fp16" else None
    b = cfg.global_batch_size
    if resident:
        x_all, y_all = x_all.to(device), y_all.to(device)
        g = torch.Generator(device=device).manual_seed(cfg.seed)

        def batches():
            while True:
                perm = torch.randperm(len(x_all), device=device, generator=g)
                for i in range(len(perm) // b):
                    idx = perm[i * b:(i + 1) * b]
                    yield x_all[idx], y_all[idx]
    else:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=b, shuffle=True,
                                             drop_last=True, pin_memory=device.type == "cuda",
                                             generator=torch.Generator().manual_seed(cfg.seed))

        def batches():
            while True:
                yield from loader
    it, clock, times = batches(), StepClock(device), StepTimes()
    model.train()
    for _ in range(cfg.max_steps):
        clock.start()
        x, y = (t.to(device, non_blocking=True) for t in next(it))
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = task_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        clock.stop(times, 0.0, 0)
    clock.flush(times)
    step_s = median_excluding_warmup(times.step, cfg.timing_warmup_steps)
    return {"time_per_step_s_median": step_s, "final_loss": float(loss.detach()),
            "mfu": _mfu(model, x.shape, step_s, device, cfg.strategy.precision)}


def _mfu(model, batch_shape, step_s: float, device: torch.device, precision: str) -> float | None:
    """The plain loop's model FLOPs utilisation (as a run's: :mod:`distlab.train.throughput`), where known."""
    from distlab.models import flops_per_token
    from distlab.runtime.device import peak_tflops
    flops, (peak, _) = flops_per_token(getattr(model, "_orig_mod", model)), peak_tflops(device, precision)
    if not flops or not peak or len(batch_shape) != 2:
        return None
    return batch_shape[0] * batch_shape[1] * flops / step_s / (peak * 1e12)


def _distlab(rank: int, world: int, cfg: TrainConfig, device_name: str) -> dict:
    from distlab import runtime
    from distlab.train import Trainer
    trainer = Trainer(cfg.validate(1), runtime.from_process_group(torch.device(device_name)))
    summary = trainer.fit()
    return {"time_per_step_s_median": summary["time_per_step_s_median"], "final_loss": summary["final_train_loss"],
            "data_on_device": summary["data_on_device"], "mfu": summary.get("mfu")}


def run(workloads=("mlp",), precisions=("fp32",), steps: int = 300, runs: int = 3, device: str = "auto",
        threads: int | None = None, dataset: str | None = None, data_dir: str | None = None, out=None,
        progress=print, compile: bool = False, sides: str | None = None) -> list[dict]:
    """Every workload x precision: ``runs`` interleaved rounds of each side; one record per side and round."""
    from distlab.runtime import cores, resolve_device
    from distlab.launch.spawn import run_ranks

    workloads = choose("--workloads", workloads, WORKLOADS)
    precisions = choose("--precisions", precisions, PRECISIONS)
    at_least(steps=(steps, 20), runs=(runs, 1))
    dev = resolve_device(device, 0).type
    if "fp16" in precisions and dev != "cuda":
        from distlab.errors import ConfigError
        raise ConfigError("--precisions fp16 needs a CUDA GPU (float16 autocast and loss scaling are GPU-only); "
                          "measure fp32 and bf16 here")
    for workload in workloads:  # every configuration checked before the first round
        cfg = config(workload, precisions[0], steps, dataset, data_dir).validate(1)
        if not cfg.dataset.startswith("synthetic"):
            from distlab.data import locate
            locate(cfg.dataset, cfg.data_dir)
    threads = threads or cores()  # one process: every core, on both sides alike
    every = ["plain", *(["plain-resident"] if dev == "cuda" else []), "distlab",
             *(["plain-compiled", "distlab-compiled"] if compile else [])]
    sides = choose("--sides", sides, every) if sides else every
    records = []
    for workload in workloads:
        for precision in precisions:
            cfg = config(workload, precision, steps, dataset, data_dir)
            for r in range(runs):
                progress(f"{workload} {precision} on {dev}: round {r + 1}/{runs} ...")
                for side in sides:
                    if side.startswith("distlab"):
                        mine = dataclasses.replace(cfg, strategy=cfg.strategy.replace(compile=side == "distlab-compiled"))
                        fn, args = _distlab, (mine, dev)
                    else:
                        fn, args = _plain, (cfg, dev, side == "plain-resident", side == "plain-compiled")
                    res = run_ranks(fn, 1, *args, timeout=3600, threads=threads, gpus=dev == "cuda")[0]
                    records.append({"workload": workload, "model": cfg.model, "dataset": cfg.dataset,
                                    "precision": precision, "device": dev, "side": side, "round": r, "steps": steps,
                                    "global_batch_size": cfg.global_batch_size, **res, **machine(1, threads)})
                    mfu = f", MFU {100 * res['mfu']:.1f}%" if res.get("mfu") else ""
                    progress(f"  {side}: {1e3 * res['time_per_step_s_median']:.3f} ms/step{mfu}")
                write(records, out, "overhead")  # each round as it ends: a run cut short keeps what it measured
    write(records, out, "overhead")
    return records


def table(records: list[dict], markdown: bool = False) -> str:
    rows = summarize(records)
    resident = any("plain-resident_s" in r for r in rows)
    compiled = any("compiled_ratio_median" in r for r in rows)
    headers = ["workload", "precision", "device", "plain ms", *(["plain, data on GPU ms"] if resident else []),
               "distlab ms", "distlab / plain", "range",
               *(["plain compiled ms", "distlab compiled ms", "compiled: distlab / plain", "range",
                  "compile speed-up", "range"] if compiled else []), "rounds"]
    cells = []
    for r in rows:
        ms = lambda side: f"{1e3 * r[side + '_s']:.2f}" if side + "_s" in r else "-"  # noqa: E731 - a side not run: -
        ratio = r["ratio_median"] is not None
        cells.append([r["workload"], r["precision"], r["device"], ms("plain"),
                      *([ms("plain-resident")] if resident else []),
                      ms("distlab"), f"{r['ratio_median']:.2f}x" if ratio else "-",
                      f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}" if ratio else "-",
                      *(_compiled_cells(r) if compiled else []), str(r["rounds"])])
    return format_table(headers, cells, markdown)


def _compiled_cells(r: dict) -> list[str]:
    if "compiled_ratio_median" not in r:
        return ["-"] * 6
    speedup = [f"{r['compile_speedup_median']:.2f}x", f"{r['compile_speedup_min']:.2f}-{r['compile_speedup_max']:.2f}"] \
        if "compile_speedup_median" in r else ["-", "-"]
    return [f"{1e3 * r['plain-compiled_s']:.2f}", f"{1e3 * r['distlab-compiled_s']:.2f}",
            f"{r['compiled_ratio_median']:.2f}x", f"{r['compiled_ratio_min']:.2f}-{r['compiled_ratio_max']:.2f}",
            *speedup]


def plot(records: list[dict], directory) -> list:
    from pathlib import Path

    from distlab.tools.plots import pyplot
    fig = figure(records)
    path = Path(directory) / "overhead.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return [path]
