"""``distlab plan --machine``: the GPU cluster a plan is for, from the flags."""

from __future__ import annotations

import math

from distlab.errors import ConfigError


def _whole_nodes(m, gpus: int | None) -> None:
    """``--gpus`` fills whole nodes (or part of one)."""
    if gpus is not None and gpus % m.gpus_per_node and gpus > m.gpus_per_node:
        raise ConfigError(f"--gpus {gpus}: {m.name} has {m.gpus_per_node} GPUs per node; give a multiple of it")


def data_parallel(strategy, gpus: int | None, nodes: int | None, machine: str, dp: int | None = None) -> int:
    """``--dp``: where it was not given, what the other dimensions leave of the cluster's GPUs (1 without a size);
    where it was, checked against ``--gpus`` before anything is divided by it."""
    from distlab.plan.gpu import load_machine
    m = load_machine(machine)
    _whole_nodes(m, gpus)
    ways = strategy.model_ways
    if dp is not None:
        if gpus is not None and dp * ways != gpus:
            raise ConfigError(f"the layout uses {dp * ways} GPUs (dp {dp} x tp {strategy.tp} x pp {strategy.pp} x cp "
                              f"{strategy.cp}) but --gpus is {gpus}: make them equal (or leave --dp out to fill the "
                              f"GPUs)")
        return dp
    total = gpus or (nodes * m.gpus_per_node if nodes else None)
    if total is None:
        return 1
    if total % ways:
        raise ConfigError(f"{total} GPUs do not divide into model-parallel groups of {ways} (tp x pp x cp = {ways}): "
                          f"give a layout whose product divides them")
    return total // ways


def cluster_of(machine: str, nodes: int | None, gpus: int | None, lay, calibration: str | None):
    """The :class:`~distlab.plan.gpu.Cluster` of ``--machine``, ``--nodes``/``--gpus`` and a GPU calibration."""
    from distlab.plan.gpu import Cluster, load_machine
    from distlab.plan.gpu_calibration import GpuCalibration
    m = load_machine(machine)
    _whole_nodes(m, gpus)
    if gpus is not None:
        if nodes is not None and nodes != math.ceil(gpus / m.gpus_per_node):
            raise ConfigError(f"--gpus {gpus} and --nodes {nodes} disagree ({m.gpus_per_node} GPUs per node): give one")
    n = nodes or math.ceil((gpus or lay.world) / m.gpus_per_node)
    cluster = Cluster(m, n)
    if calibration:
        GpuCalibration.load(calibration).apply(cluster)
    return cluster


def calibrate_device(device: str, preset: str | None, model: str | None, block_size: int, precision: str,
                     output: str) -> None:
    """``plan calibrate --device``: time the model's layer shapes on ``device`` and write the rates."""
    import json

    import click
    import torch

    from distlab.models import build_model
    from distlab.plan.gpu_calibration import measure
    from distlab.train.metrics import atomic_write_text
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device here; run it on one of the machine's GPUs")
    if preset or (model or "").startswith("hf:"):
        from distlab.models import hf
        from distlab.plan import presets
        name, options, vocab = presets.options(preset) if preset else \
            (lambda r: (r[0], r[2], r[3]))(hf.plannable(model[3:]))
    elif model:  # a registered model at its family's default sizes
        name, options, vocab = model, None, 256
    else:
        raise ConfigError("--device measures a model's layer shapes: give --preset NAME or --model")
    from distlab.runtime.meta import on_meta_device
    with on_meta_device():
        net = build_model(name, (block_size,), vocab, options=options)
    linears = sorted({(m.in_features, m.out_features) for m in net.modules() if isinstance(m, torch.nn.Linear)})
    from distlab.models.plans import declared_plan  # the attentions the model declares (its context plan): the
    cores = [net.get_submodule(n) for n, kind in declared_plan(net, "context", cp=1, style="ring", tp=1).items()
             if kind == "context_attention"]  # queries they take, (batch, heads, tokens, head width)
    if not cores:
        raise ConfigError(f"{name} declares no attention (context_parallel_plan) to time")
    seen = []
    hook = cores[0].register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    net(torch.zeros(1, block_size, dtype=torch.long, device="meta"))
    hook.remove()
    _, heads, _, head_dim = seen[0]
    cal = measure(linears, heads, head_dim, block_size, torch.device(device), precision)
    atomic_write_text(output, json.dumps(cal.to_dict(), indent=1) + "\n")
    eff = f", {cal.efficiency:.1%} of its {cal.peak_flops / 1e12:g} TFLOP/s peak" if cal.efficiency else \
        " (no datasheet peak: a plan cannot use it)"
    click.echo(f"{cal.device}: matrix multiplications {cal.matmul_flops / 1e12:.3g} TFLOP/s, attention "
               f"{cal.attention_flops / 1e12:.3g} TFLOP/s{eff}")
    click.echo(f"wrote {output}", err=True)


def dry_run_text(p: dict) -> str:
    """The dry run's measurement beside the plan: the rank's stage's planned state and activations."""
    d = p["dry_run"]
    stages = p.get("pipeline", {}).get("stages")
    if stages:
        stage = stages[d["rank"] * len(stages) // d["world_size"]]
        state, acts = stage["model_state_bytes"], stage["activation_bytes"]
    else:
        state, acts = p["model_state_bytes_per_rank"], p["activation_bytes_float32_per_rank"]  # (the meta device
        # runs no autocast: float32 throughout)
    same = "equal" if d["model_state_bytes"] == state else f"plan {state:,} bytes"
    rel = d["activation_bytes"] / acts - 1 if acts else 0.0
    return (f"dry run       rank {d['rank']} of {d['world_size']} on the meta device (fake process group), measured in "
            f"{d['seconds']:.1f} s: model state {d['model_state_bytes']:,} bytes ({same}), activations "
            f"{d['activation_bytes'] / 2**30:.3g} GiB (plan {acts / 2**30:.3g} GiB, {rel:+.1%})")
