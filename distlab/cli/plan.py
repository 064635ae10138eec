"""``distlab plan``: predict step time and memory; calibrate and validate the cost model."""

from __future__ import annotations

import sys

import click

from distlab.cli.flag_tables import MODEL_OPTIONS, STRATEGY_OPTIONS
from distlab.cli.options import (COUNT, Number, csv_ints, field_options,
                                 model_options_of, output_file)
from distlab.errors import ConfigError

DEFAULT_CALIBRATION = "runs/calibration.json"
PLANNED_FIELDS = ("dp_sync", "collective", "bucket_mb", "grad_accum", "tp", "sequence_parallel", "cp", "cp_style", "ep",
                  "zero", "pp",
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
@click.option("--dp", type=COUNT, default=1, show_default=True, help="Data-parallel ranks.")
@field_options([row for row in STRATEGY_OPTIONS if row[0] in PLANNED_FIELDS])
@field_options([("optimizer", dict(help="sgd, adam or adamw (sizes the optimizer state).")),
                ("momentum", dict(type=Number(0.0, 1.0, high_open=True), help="SGD momentum (0: no momentum buffer).")),
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
@click.pass_context
def plan(ctx, model, dataset, block_size, vocab_size, num_params, activation_bytes, layers, ignored_targets, label_smoothing, dp,
         optimizer, momentum, global_batch_size, link, latency, burst, threads, calibration, sweep, strategies,
         device_memory, min_efficiency, json_out, timeline_out, preset, machine, nodes, gpus, search_, top, dry_rank, lora,
         **strategy_fields):
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
    _refuse_what_would_do_nothing(ctx, sweep, search_, machine, num_params, dry_rank, timeline_out, lora)
    from distlab.models.lora import LoRASpec
    lora = LoRASpec.of(lora)
    import json as _json
    import os as _os
    import platform
    from distlab.data import dataset_shape
    from distlab import plan as pp
    from distlab.plan.trace import generic_trace, trace
    from distlab.plan import machine as mach
    if (model.startswith("hf:") or preset) and num_params is None:  # a config alone: its family, options and
        from distlab.models import hf                                    # vocabulary (no weights read)
        from distlab.plan import presets
        if any(strategy_fields.get(name) is not None for name, _ in MODEL_OPTIONS):
            raise ConfigError(f"--{'preset ' + preset if preset else 'model ' + model} takes its sizes from its "
                              f"config.json: drop the model flags")
        [strategy_fields.pop(name) for name, _ in MODEL_OPTIONS]
        if preset:
            model, options, vocab_size = presets.options(preset)
        else:
            model, _, options, vocab_size = hf.plannable(model[3:])
        if ctx.get_parameter_source("dataset") is click.core.ParameterSource.DEFAULT:
            dataset = "synthetic-text"  # token windows of --block-size
    else:
        options = model_options_of(model, strategy_fields) if num_params is None else \
            [strategy_fields.pop(name) for name, _ in MODEL_OPTIONS]  # the model (and its options) ignored
    if num_params is not None:
        if activation_bytes is None:
            click.echo("distlab: warning: --params without --activation-bytes: activations are counted as 0 bytes "
                       "per sample (give their bytes per sample for the memory they take)", err=True)
        t = generic_trace(int(num_params), activation_bytes or 0.0, layers)
    else:
        from distlab.data import is_text
        from distlab.models import is_text_model, is_user_model
        if not is_user_model(model) and is_text_model(model) != is_text(dataset):
            if ctx.get_parameter_source("dataset") is not click.core.ParameterSource.DEFAULT:
                raise ConfigError(f"model {model} {'predicts tokens' if is_text_model(model) else 'classifies images'}"
                                  f" but dataset {dataset} is {'text' if is_text(dataset) else 'images'}: give "
                                  + ("--model gpt" if is_text(dataset) else "a text dataset (fortunes, "
                                                                             "synthetic-text, text:PATH)"))
            dataset = "synthetic-text"  # a language model's default: token windows of --block-size
        shape, k = dataset_shape(dataset, block_size)
        if vocab_size is not None and vocab_size < k:
            raise ConfigError(f"--vocab-size {vocab_size:,} is smaller than {dataset}'s {k:,} tokens")
        t = trace(model, shape, vocab_size or k, options=options,
                  lora=lora, attention="flash" if machine else "math")
    path = None if machine else calibration or (DEFAULT_CALIBRATION if _os.path.exists(DEFAULT_CALIBRATION) else None)
    cal = pp.Calibration.load(path) if path else None
    from distlab.data.preference import is_preference
    from distlab.parallel import Strategy
    if strategy_fields.get("pp_balance") is not None:
        strategy_fields["pp_balance"] = csv_ints(strategy_fields["pp_balance"])
    cluster = None
    if machine:
        from distlab.cli.plan_gpu import cluster_of, data_parallel
        given = ctx.get_parameter_source("dp") is not click.core.ParameterSource.DEFAULT
        dp = data_parallel(Strategy(**strategy_fields), gpus, nodes, machine, dp if given else None)
    elif nodes or gpus:
        raise ConfigError("--nodes and --gpus describe a GPU cluster: give --machine too (e.g. --machine h100-sxm)")
    lay = pp.Layout(dp=dp, strategy=Strategy(**strategy_fields), optimizer=optimizer, momentum=momentum,
                    global_batch=global_batch_size, threads=threads, ignored_targets=ignored_targets,
                    label_smoothing=label_smoothing > 0, pairs=is_preference(dataset)).check()
    if machine:
        cluster = cluster_of(machine, nodes, gpus, lay, calibration)
    net = mach.Link.parse(link, latency, burst)
    if search_:
        if cluster is None or gpus is None and nodes is None:
            raise ConfigError("--search enumerates the layouts of a GPU cluster: give --machine and --gpus (or --nodes)")
        from distlab.plan.search import search
        from distlab.plan.text import format_search
        experts = (options.to_dict() if options is not None else {}).get("experts") or 0  # a mixture's experts
        from distlab.plan.search import SEARCHED
        given = {k for k in strategy_fields if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT}
        if given & {"dp_sync", "collective"}:
            flag = sorted(given & {"dp_sync", "collective"})[0].replace("_", "-")
            raise ConfigError(f"--{flag} with --search: each layout syncs its gradients as a run of it would by "
                              f"default (ZeRO its own way); drop it, or plan that one layout without --search")
        fixed = {k: getattr(lay.strategy, k) for k in SEARCHED if k in given}  # what was given is kept
        result = search(t, lay, cluster, top, experts=experts, fixed=fixed)
        click.echo(format_search(result))
    elif sweep:
        given = [k for k in strategy_fields if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} with --sweep: the sweep compares the layouts of "
                              f"--strategies (now {strategies}); put it there, e.g. --strategies zero=3,bucketed")
        worlds = list(csv_ints(sweep))
        if not worlds or min(worlds) < 1:
            raise ConfigError(f"--sweep needs positive world sizes, not {sweep!r}")
        strats = [Strategy.parse(s) for s in strategies.split(",") if s]
        limit = mach.parse_bytes(device_memory) if device_memory else None
        if cluster is not None:
            raise ConfigError("--sweep with --machine: use --search (every layout of --gpus on the machine)")
        result = pp.sweep(t, lay, worlds, net, cal, limit, strats)
        click.echo(pp.format_sweep(result, min_efficiency))
    else:
        result = pp.predict(t, lay, net, cal, cluster)
        click.echo(pp.format_prediction(result))
        if dry_rank is not None:
            if num_params is not None:
                raise ConfigError("--dry-run builds the model: give --model or --preset, not --params")
            from distlab.cli.plan_gpu import dry_run_text
            from distlab.plan.dry_run import dry_run
            result["dry_run"] = dry_run(model, options, vocab_size or k, shape, lay.strategy, lay.world, dry_rank,
                                        lay.global_batch, optimizer or "sgd",
                                        lora=lora,
                                        attention="flash" if machine else "math")
            click.echo(dry_run_text(result))
        if timeline_out:
            _write_timeline(result, str(lay.strategy), timeline_out)
    if cluster is not None and cluster.calibrated_on is not None and \
            cluster.machine.name.split("-")[0].upper() not in cluster.calibrated_on.upper():
        click.echo(f"distlab: warning: the compute rate was measured on {cluster.calibrated_on}, not on "
                   f"{cluster.machine.name}'s GPUs: calibrate on one of them for its own", err=True)
    if cluster is not None and cluster.calibrated_on is None:
        click.echo(f"distlab: warning: {cluster.machine.name} was not calibrated: compute at {cluster.efficiency:.1%} of "
                   f"its datasheet peak, measured as {cluster.efficiency_source}; run `distlab plan calibrate --device "
                   f"cuda` on one of its GPUs for its own rates", err=True)
    if cal is not None and cal.machine.get("host") not in (None, platform.node()):
        click.echo(f"distlab: warning: the step times are those of {cal.machine.get('host')}, where {path} was "
                   f"measured, not of this machine ({platform.node()}); give --machine for a GPU cluster", err=True)
    if cal is not None:
        click.echo(f"(calibration: {path}, {cal.machine.get('host', '?')}, {cal.machine.get('date', '?')})", err=True)
        if device_memory and cal.machine.get("device", "cpu") == "cpu":
            click.echo(f"distlab: warning: the step times come from a calibration measured on the CPUs of "
                       f"{cal.machine.get('host', '?')} ({cal.machine.get('cores', '?')} cores), not on devices of "
                       f"{device_memory}: they are that machine's times; run `distlab plan calibrate` on the target "
                       f"for its own (the memory columns hold anywhere)", err=True)
    if json_out:
        from distlab.train.metrics import atomic_write_text
        atomic_write_text(json_out, _json.dumps(result, indent=1) + "\n")
        click.echo(f"wrote {json_out}", err=True)


def _write_timeline(result: dict, label: str, out: str) -> None:
    """The predicted step's timeline: a Chrome trace and its Gantt chart beside it."""
    import json as _json
    from pathlib import Path

    from distlab.runtime.trace_file import predicted_trace
    from distlab.tools.plots import pyplot
    from distlab.tools.report.timelines import gantt
    from distlab.train.metrics import atomic_write_text
    if "timeline" not in result:
        raise ConfigError("--timeline draws the predicted step's time: give a calibration (--calibration, from "
                          "`distlab plan calibrate`); without one plan predicts memory only")
    trace = predicted_trace(result["timeline"], f"predicted: {label}")
    atomic_write_text(out, _json.dumps(trace) + "\n")
    png = Path(out).with_suffix(".png")
    fig = gantt(trace, f"predicted: {label}")
    fig.savefig(png, dpi=90, bbox_inches="tight")
    pyplot().close(fig)
    click.echo(f"wrote {out} and {png}", err=True)


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
