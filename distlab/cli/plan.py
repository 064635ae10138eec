"""``distlab plan``: predict step time and memory; calibrate and validate the cost model."""

from __future__ import annotations

import sys

import click

from distlab.cli.flag_tables import MODEL_OPTIONS, STRATEGY_OPTIONS
from distlab.cli.options import (COUNT, Number, field_options,
                                 output_file)
from distlab.errors import ConfigError

DEFAULT_CALIBRATION = "runs/calibration.json"
PLANNED_FIELDS = ("dp_sync", "collective", "bucket_mb", "grad_accum", "tp", "sequence_parallel", "cp", "cp_style", "ep", "ep_dispatch",
                  "zero", "dp_shard", "zero_impl", "pp",
                  "microbatches", "pp_schedule", "pp_virtual", "pp_balance", "activation_checkpointing", "ac_every",
                  "ac_policy", "precision", "reduce_dtype", "grad_compression")  # what plan's cost model reads


@click.group(invoke_without_command=True)
@click.option("--model", default="mlp", show_default=True,
              help="A registered model, or hf:DIR: a Hugging Face checkpoint's model from its config.json alone "
                   "(family, options, vocabulary, context; no weights read); ignored with --params.")
@field_options(MODEL_OPTIONS)
@click.option("--dataset", default="fashion-mnist", show_default=True, help="Gives the input shape and classes.")
@click.option("--block-size", type=COUNT, default=64, show_default=True, help="A language model's window in tokens.")
@click.option("--vocab-size", type=COUNT, default=None,
              help="A language model's vocabulary (default: the data's; hf:DIR's config gives its own).")
@click.option("--params", "num_params", type=Number(0.0, low_open=True), default=None,
              help="Plan for a model known only by its parameter count (e.g. 7e9) instead of --model.")
@click.option("--activation-bytes", type=Number(0.0), default=None,
              help="With --params: activation bytes per sample.")
@click.option("--layers", type=COUNT, default=24, show_default=True, help="With --params: number of equal layers.")
@click.option("--ignored-targets/--no-ignored-targets", default=False, show_default=True,
              help="Some targets are not scored (label -100: a fine-tuning prompt's): the kept count is summed "
                   "over the replicas each step.")
@click.option("--label-smoothing", type=Number(0.0, 1.0), default=0.0, show_default=True,
              help="The loss smooths its labels (one more reduction per token across a split vocabulary).")
@click.option("--group-size", type=COUNT, default=4, show_default=True,
              help="rl:FILE.jsonl (GRPO): completions per prompt, each a window the update trains.")
@click.option("--max-new-tokens", type=COUNT, default=None,
              help="GRPO: each completion's budget in tokens, the rollout priced as if each ran to it (default: "
                   "half the window).")
@click.option("--kl-beta", type=Number(0.0), default=0.0, show_default=True,
              help="GRPO: a KL penalty's weight (above 0 the rollout scores its rows under the reference too).")
@click.option("--ppo-epochs", type=COUNT, default=1, show_default=True,
              help="GRPO: passes over each rollout (above 1 it scores the rows' old log-probabilities).")
@click.option("--dp", type=COUNT, default=1, show_default=True, help="Data-parallel ranks.")
@field_options([row for row in STRATEGY_OPTIONS if row[0] in PLANNED_FIELDS])
@field_options([("optimizer", dict(help="sgd, adam, adamw or muon (sizes the optimizer state).")),
                ("momentum", dict(type=Number(0.0, 1.0, high_open=True), help="SGD momentum (0: no momentum buffer).")),
                ("optimizer_state", dict(help="adam/adamw: the moments' dtype, fp32 or bf16 (2 bytes each).")),
                ("offload", dict(help="none, optimizer (the optimizer's state off the device) or params (with zero 3: "
                                 "the parameter shards too); priced as bytes held off the device and moved a step.")),
                ("offload_overlap", dict(is_flag=True, help="With offload (not ZeRO-1/2, not Muon): the host's step "
                                         "beside the next step's first forward, which hides up to its time.")),
                ("global_batch_size", dict(type=int, aliases=("--global-batch",),
                                           help="Global batch, as train's; with --sweep its per-rank share at --dp "
                                                "is kept at every size (weak scaling)."))])
@click.option("--link", default="loopback", show_default=True,
              help="Each node's link: loopback (this machine) or a rate like 100mbit, 10gbit, 100gbit.")
@click.option("--latency", default=None, help="Link latency per message round, e.g. 5us or 0.1ms.")
@click.option("--burst", default=None, help="Token-bucket burst of the link (the emulated cluster's is 512kb).")
@click.option("--threads", type=COUNT, default=None, help="Threads per rank (picks the compute calibration).")
@click.option("--calibration", default=None,
              help=f"Calibration JSON from `distlab plan calibrate` (default {DEFAULT_CALIBRATION} if it exists; "
                   "without one, memory only).")
@click.option("--sweep", default=None, help="Data-parallel world sizes to sweep, e.g. 1,8,64,512,4096 (weak scaling).")
@click.option("--strategies", default="bucketed,zero=1,zero=2,zero=3", show_default=True,
              help="With --sweep: strategies to compare, in the text form of --strategy (e.g. ddp, zero=3, "
                   "bucketed:ring+accum=2, allreduce+tp=2).")
@click.option("--device-memory", default=None, help="With --sweep: memory per device, e.g. 80GiB.")
@click.option("--min-efficiency", type=Number(0.0, 1.0), default=0.5, show_default=True,
              help="With --sweep: below this scaling efficiency a strategy has stopped scaling.")
@click.option("--json", "json_out", default=None, callback=output_file, help="Also write the prediction(s) as JSON here.")
@click.option("--timeline", "timeline_out", default=None, callback=output_file,
              help="Also write the predicted step as a timeline here (needs a calibration): FILE in Chrome's "
                   "trace format, the same lanes as a run's --trace, and FILE's .png, its Gantt chart.")
@click.option("--preset", default=None, metavar="NAME",
              help="A published model by name (its config.json's numbers): llama3-8b, llama3.1-8b, llama3-70b, "
                   "llama3.1-70b, llama3.1-405b, llama3.2-1b, llama2-13b, llama2-70b, qwen3-32b, mixtral-8x7b.")
@click.option("--machine", default=None, metavar="NAME|FILE.toml",
              help="Plan for a GPU cluster of this machine: h100-sxm, h200, a100-80g, b200, h100-grand-teton, or a "
                   "FILE.toml of the same fields (datasheet numbers; distlab/plan/machines/).")
@click.option("--nodes", type=COUNT, default=None, help="With --machine: nodes (default: as many as the layout needs).")
@click.option("--gpus", type=COUNT, default=None,
              help="With --machine: GPUs in all (a whole number of nodes); --dp defaults to what the other "
                   "dimensions leave of them.")
@click.option("--search", "search_", is_flag=True,
              help="With --machine and --gpus: predict every valid layout (dp x tp x pp x cp x ep, ZeRO stage, "
                   "checkpointing, micro-batches, schedule), keep those that fit, rank them by tokens/s per GPU.")
@click.option("--top", type=COUNT, default=10, show_default=True, help="With --search: how many layouts to print.")
@click.option("--dry-run", "dry_rank", type=click.IntRange(0), default=None, metavar="RANK",
              help="Also build rank RANK's part of the layout at full size on the meta device (torch's fake process "
                   "group for the other ranks), run two steps of distlab's code on it and measure its model state "
                   "and saved activations beside the plan's: no memory, no GPU, any size.")
@click.option("--lora", default=None, help="r=16,alpha=32,targets=q,k,v,o -- the model with low-rank adapters, "
              "the rest frozen (as distlab train --lora): gradients, their sync and optimizer state for the "
              "adapters only.")
@click.option("--base-dtype", type=click.Choice(["float32", "bf16", "nf4"]), default="float32", show_default=True,
              help="With --lora: the frozen base held in bf16, or nf4 (each adapted weight in 4-bit NormalFloat, "
                   "QLoRA; the rest bf16) -- as distlab train --base-dtype.")
@click.pass_context
def plan(ctx, **kw):
    """Predict time per step and memory per rank of a layout, before running it.

    \b
    distlab plan --model resnet18 --dataset cifar10 --dp 8 --zero 2 --link 10gbit
    distlab plan --params 7e9 --activation-bytes 4e6 --link 100gbit --sweep 8,64,512,4096 --device-memory 80GiB
    distlab plan --model gpt --dataset fortunes --dp 2 --tp 2 --pp 2 --microbatches 4 --sequence-parallel
    distlab plan --model gpt-moe --experts 8 --dataset fortunes --dp 4 --ep 4
    distlab plan --model hf:Meta-Llama-3-8B --block-size 8192 --dp 8 --zero 3 --precision bf16
    distlab plan calibrate runs/bench-collectives runs/bench-scaling -o runs/calibration.json
    distlab plan validate runs/bench-scaling-cluster
    """
    if ctx.invoked_subcommand is not None:
        return
    _refuse_what_would_do_nothing(ctx, kw["sweep"], kw["search_"], kw["machine"], kw["num_params"], kw["dry_rank"],
                                  kw["timeline_out"], kw["lora"])
    from distlab.cli import plan_modes
    setting = plan_modes.setting(ctx, kw)
    mode = plan_modes.search if kw["search_"] else plan_modes.sweep if kw["sweep"] else plan_modes.one_layout
    result = mode(ctx, setting, kw)
    plan_modes.warn_about_the_machine(setting, kw["device_memory"])
    if kw["json_out"]:
        import json as _json

        from distlab.train.metrics import atomic_write_text
        atomic_write_text(kw["json_out"], _json.dumps(result, indent=1) + "\n")
        click.echo(f"wrote {kw['json_out']}", err=True)


def _refuse_what_would_do_nothing(ctx, sweep, search_, machine, num_params, dry_rank, timeline_out, lora) -> None:
    """A flag the plan asked for would not read is refused, naming the plan that reads it (as train refuses)."""

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT

    for name in ("strategies", "device_memory", "min_efficiency"):  # settings of the sweep alone
        if not sweep and given(name):
            raise ConfigError(f"--{name.replace('_', '-')} is for --sweep (layouts compared over world sizes): give "
                              f"--sweep N,N,..., or plan one layout by its own flags (--zero 3, --tp 2, ...), or every "
                              f"layout of a GPU cluster with --machine NAME --gpus N --search")
    for name in ("link", "latency", "burst", "threads"):  # this machine's emulated network and CPU threads
        if machine and given(name):
            where = machine if machine.endswith(".toml") else f"distlab/plan/machines/{machine}.toml"
            raise ConfigError(f"--{name} with --machine: a GPU cluster's links and compute are its machine's "
                              f"({where}); drop --{name}, or describe another machine in a FILE.toml of the same "
                              f"fields")
    for name in ("layers", "activation_bytes"):  # the sizes of a model known by its parameters alone
        if num_params is None and given(name):
            raise ConfigError(f"--{name.replace('_', '-')} is for --params (a model known by its size alone); a "
                              f"model given by --model or --preset is traced for its own layers and activations")
    for flag, value in (("--dry-run", dry_rank), ("--timeline", timeline_out)):  # of one layout's plan
        for many, asked in (("--sweep", sweep), ("--search", search_)):
            if value is not None and asked:
                raise ConfigError(f"{flag} with {many}: it is of one layout; plan that layout by its own flags "
                                  f"(without {many}) with {flag}")
    if lora is not None and num_params is not None:
        raise ConfigError("--lora with --params: adapters go on a traced model's layers; give --model or --preset")
    if lora is None and given("base_dtype"):
        raise ConfigError("--base-dtype is the frozen base's under --lora: give --lora r=...,targets=... (without "
                          "adapters every weight trains, in the run's own dtype)")
    if not search_ and given("top"):
        raise ConfigError("--top is for --search (how many of the ranked layouts to show): give --machine NAME "
                          "--gpus N --search")


@plan.command("calibrate")
@click.argument("paths", nargs=-1)
@click.option("-o", "--output", default=DEFAULT_CALIBRATION, callback=output_file, show_default=True)
@click.option("--device", default=None, help="Measure this device's rates instead (cuda, cuda:1, cpu): the model's own "
              "matrix multiplications and attention, forward and backward, for `plan --machine ... --calibration`.")
@click.option("--preset", default=None, help="With --device: the model whose layer shapes to time (a preset name).")
@click.option("--model", default=None, help="With --device: hf:DIR, or a registered model with its default sizes.")
@click.option("--block-size", type=COUNT, default=2048, show_default=True, help="With --device: tokens per timed call.")
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True)
def plan_calibrate(paths, output, device, preset, model, block_size, precision):
    """Fit collectives' latency and bandwidth (alpha-beta) and the compute rate from bench results; or, with
    --device, measure a GPU's matrix-multiplication and attention rates on a model's shapes.

    PATHS: `distlab bench collectives` output, run directories of one-worker training runs and
    `distlab bench scaling` output (its one-worker runs), or directories holding them.

    \b
    distlab plan calibrate runs/bench-collectives runs/bench-scaling -o runs/calibration.json
    distlab plan calibrate --device cuda --preset llama3-8b --block-size 8192 -o results/h100-rates.json"""
    if device:
        from distlab.cli.plan_gpu import calibrate_device
        calibrate_device(device, preset, model, block_size, precision, output)
        return
    if not paths:
        raise ConfigError("`distlab plan calibrate` needs bench results (PATHS) or --device to measure")
    from distlab import plan as pp
    cal = pp.calibrate(list(paths))
    from distlab.train.metrics import atomic_write_text
    atomic_write_text(output, cal.to_json())
    for name, ab in cal.collectives.items():
        per_byte = (f"beta {ab.beta * 1e9:7.3f} ns/byte ({1 / ab.beta / 1e9:.2f} GB/s)" if ab.beta else
                    "beta not measured (the times did not grow with the bytes: too small --sizes, or a busy "
                    "machine; bench larger sizes on a quiet one)")
        click.echo(f"{name:<15} alpha {ab.alpha * 1e6:8.1f} us/round  {per_byte}  {ab.points} points, "
                   f"median |error| {ab.median_rel_err:.1%}, max {ab.max_rel_err:.1%}")
    for c in cal.compute.values():
        click.echo(f"compute         {c.rate / 1e9:8.2f} GFLOP/s + {c.overhead * 1e3:.2f} ms/step at {c.threads} "
                   f"threads/rank  {c.points} runs, median |error| {c.median_rel_err:.1%}, max {c.max_rel_err:.1%}")
    click.echo(f"wrote {output} ({len(cal.sources)} sources)", err=True)


@plan.command("published")
@click.argument("keys", nargs=-1)
@click.option("--json", "json_out", default=None, callback=output_file, help="Write the rows and errors here.")
def plan_published(keys, json_out):
    """Predict published multi-GPU runs of other projects (torchtitan's, Meta's Llama 3) on their machines:
    tokens/s (or TFLOP/s) per GPU and peak memory, the error per row. KEYS: some rows only."""
    import json as _json

    from distlab.bench.published_table import format_compare
    from distlab.plan.published import compare
    from distlab.train.metrics import atomic_write_text
    result = compare(list(keys) or None)
    click.echo(format_compare(result))
    if json_out:
        from distlab.bench.common import machine
        result["machine"] = machine(1, 1)
        atomic_write_text(json_out, _json.dumps(result, indent=1) + "\n")
        click.echo(f"wrote {json_out}", err=True)


@plan.command("validate")
@click.argument("paths", nargs=-1, required=True)
@click.option("--calibration", default=DEFAULT_CALIBRATION, show_default=True)
@click.option("--json", "json_out", default=None, callback=output_file, help="Write the per-run comparison here.")
@click.option("--target", type=Number(0.0, low_open=True), default=0.2, show_default=True,
              help="Exit 1 if the median absolute step-time error is above this.")
@click.option("--min-world", type=COUNT, default=2, show_default=True,
              help="Only runs with at least this many workers (1 also checks the compute model alone).")
def plan_validate(paths, calibration, json_out, target, min_world):
    """Compare predictions with measured runs (run directories, bench scaling JSON): per-run error."""
    import json as _json
    from distlab import plan as pp
    cal = pp.Calibration.load(calibration)
    rows = pp.validate(cal, list(paths), world_min=min_world)
    per_kind = pp.summaries(rows)
    click.echo(pp.format_validation(rows, per_kind))
    judged = per_kind.get("training") or per_kind["collective"]  # the target is on training runs when given
    if json_out:
        from distlab.train.metrics import atomic_write_text
        atomic_write_text(json_out, _json.dumps({"kind": "distlab-plan-validation",
                                                 "summary": {**judged, "target": target, "calibration": calibration,
                                                             "calibration_machine": cal.machine},
                                                 "summaries": per_kind, "runs": rows}, indent=1) + "\n")
        click.echo(f"wrote {json_out}", err=True)
    if judged["median_abs_time_err"] > target:
        click.echo(f"distlab: median |error| {judged['median_abs_time_err']:.1%} is above the target {target:.0%}",
                   err=True)
        sys.exit(1)


# --------------------------------------------------------------------------- cluster
