"""``distlab plan``'s modes: what every mode plans (:func:`setting`: the model traced, the layout, the link, the
calibration or the GPU cluster), then one of them -- :func:`one_layout` (a prediction, its dry run and
timeline), :func:`sweep` (layouts over world sizes on this host's calibration) and :func:`search` (every layout
of a GPU cluster, ranked) -- and the warnings about the machine the times are of."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import click

from distlab.cli.flag_tables import MODEL_OPTIONS
from distlab.cli.options import csv_ints, model_options_of
from distlab.errors import ConfigError

DEFAULT_CALIBRATION = "runs/calibration.json"


@dataclass
class Setting:
    """What a plan is of: the model's trace (and how it was made: its family, options, vocabulary and sample
    shape, for a dry run), the layout, the link, and the machine the times come from."""

    trace: object
    layout: object
    link: object
    calibration: object | None
    calibration_path: str | None
    cluster: object | None
    model: str
    options: object | None
    vocab: int | None
    shape: tuple | None
    lora: object | None


def _given(ctx, name: str) -> bool:
    return ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT


def _trace(ctx, kw: dict, fields: dict):
    """(the trace, the model, its options, vocabulary, sample shape): a model known by its size alone
    (``--params``), or a family (a registered one, a preset's or hf:DIR's config) traced on the meta device."""
    from distlab.data import dataset_shape
    from distlab.plan.trace import generic_trace, trace
    model, dataset, preset, vocab = kw["model"], kw["dataset"], kw["preset"], kw["vocab_size"]
    if (model.startswith("hf:") or preset) and kw["num_params"] is None:  # a config alone: its family, options
        from distlab.models import hf                                         # and vocabulary (no weights read)
        from distlab.plan import presets
        if any(fields.get(name) is not None for name, _ in MODEL_OPTIONS):
            raise ConfigError(f"--{'preset ' + preset if preset else 'model ' + model} takes its sizes from its "
                              f"config.json: drop the model flags")
        [fields.pop(name) for name, _ in MODEL_OPTIONS]
        if preset:
            model, options, vocab = presets.options(preset)
        else:
            model, _, options, vocab = hf.plannable(model[3:])
        if not _given(ctx, "dataset"):
            dataset = "synthetic-text"  # token windows of --block-size
    else:
        options = model_options_of(model, fields) if kw["num_params"] is None else \
            [fields.pop(name) for name, _ in MODEL_OPTIONS]  # the model (and its options) ignored
    if kw["num_params"] is not None:
        if kw["activation_bytes"] is None:
            click.echo("distlab: warning: --params without --activation-bytes: activations are counted as 0 bytes "
                       "per sample (give their bytes per sample for the memory they take)", err=True)
        return generic_trace(int(kw["num_params"]), kw["activation_bytes"] or 0.0, kw["layers"]), model, options, \
            vocab, None, dataset
    from distlab.data import is_text
    from distlab.models import is_text_model, is_user_model
    if not is_user_model(model) and is_text_model(model) != is_text(dataset):
        if _given(ctx, "dataset"):
            raise ConfigError(f"model {model} {'predicts tokens' if is_text_model(model) else 'classifies images'}"
                              f" but dataset {dataset} is {'text' if is_text(dataset) else 'images'}: give "
                              + ("--model gpt" if is_text(dataset) else "a text dataset (fortunes, "
                                                                         "synthetic-text, text:PATH)"))
        dataset = "synthetic-text"  # a language model's default: token windows of --block-size
    shape, k = dataset_shape(dataset, kw["block_size"])
    if vocab is not None and vocab < k:
        raise ConfigError(f"--vocab-size {vocab:,} is smaller than {dataset}'s {k:,} tokens")
    t = trace(model, shape, vocab or k, options=options, lora=kw["lora"], base_dtype=kw["base_dtype"],
              attention="flash" if kw["machine"] else "math")
    return t, model, options, vocab or k, shape, dataset


def setting(ctx, kw: dict) -> Setting:
    """What every mode plans, from the command's flags (``kw``; the strategy's own fields among them)."""
    from distlab import plan as pp
    from distlab.data.preference import is_preference
    from distlab.data.rl import is_rl
    from distlab.models.lora import LoRASpec
    from distlab.parallel import Strategy
    from distlab.plan import machine as mach
    kw["lora"] = LoRASpec.of(kw["lora"])
    fields = {name: kw[name] for name in _strategy_fields(kw, options=True)}
    t, model, options, vocab, shape, dataset = _trace(ctx, kw, fields)
    machine, nodes, gpus, dp = kw["machine"], kw["nodes"], kw["gpus"], kw["dp"]
    path = None if machine else kw["calibration"] or (DEFAULT_CALIBRATION if os.path.exists(DEFAULT_CALIBRATION)
                                                      else None)
    cal = pp.Calibration.load(path) if path else None
    if fields.get("pp_balance") is not None:
        fields["pp_balance"] = csv_ints(fields["pp_balance"])
    if machine:
        from distlab.cli.plan_gpu import data_parallel
        dp = data_parallel(Strategy(**fields), gpus, nodes, machine, dp if _given(ctx, "dp") else None)
    elif nodes or gpus:
        raise ConfigError("--nodes and --gpus describe a GPU cluster: give --machine too (e.g. --machine h100-sxm)")
    lay = pp.Layout(dp=dp, strategy=Strategy(**fields), optimizer=kw["optimizer"], momentum=kw["momentum"],
                    optimizer_state=kw["optimizer_state"], offload=kw["offload"], offload_overlap=kw["offload_overlap"],
                    global_batch=kw["global_batch_size"], threads=kw["threads"],
                    ignored_targets=kw["ignored_targets"], label_smoothing=kw["label_smoothing"] > 0,
                    pairs=is_preference(dataset), group=kw["group_size"] if is_rl(dataset) else 1,
                    max_new_tokens=kw["max_new_tokens"] or 0, kl_beta=kw["kl_beta"], ppo_epochs=kw["ppo_epochs"]
                    ).check()
    cluster = None
    if machine:
        from distlab.cli.plan_gpu import cluster_of
        cluster = cluster_of(machine, nodes, gpus, lay, kw["calibration"])
    return Setting(t, lay, mach.Link.parse(kw["link"], kw["latency"], kw["burst"]), cal, path, cluster, model,
                   options, vocab, shape, kw["lora"])


def _strategy_fields(kw: dict, options: bool = False) -> list[str]:
    """The flags that are the strategy's fields (``options``: and the model's options)."""
    from distlab.parallel import Strategy
    from dataclasses import fields
    names = {f.name for f in fields(Strategy)} | ({name for name, _ in MODEL_OPTIONS} if options else set())
    return [k for k in kw if k in names]


def search(ctx, s: Setting, kw: dict) -> dict:
    """``--search``: every layout of the cluster's GPUs, ranked (what was given kept)."""
    from distlab.plan.search import LEVER_FIELDS, SEARCHED
    from distlab.plan.search import search as ranked
    from distlab.plan.text import format_search
    if s.cluster is None or kw["gpus"] is None and kw["nodes"] is None:
        raise ConfigError("--search enumerates the layouts of a GPU cluster: give --machine and --gpus (or --nodes)")
    experts = (s.options.to_dict() if s.options is not None else {}).get("experts") or 0  # a mixture's experts
    given = {k for k in _strategy_fields(kw) if _given(ctx, k)}
    if given & {"dp_sync", "collective"}:
        flag = sorted(given & {"dp_sync", "collective"})[0].replace("_", "-")
        raise ConfigError(f"--{flag} with --search: each layout syncs its gradients as a run of it would by "
                          f"default (ZeRO its own way); drop it, or plan that one layout without --search")
    fixed = {k: getattr(s.layout.strategy, k) for k in SEARCHED if k in given}
    fixed |= {k: kw[k] for k in LEVER_FIELDS if _given(ctx, k)}  # (the memory levers: offload, the state's dtype)
    result = ranked(s.trace, s.layout, s.cluster, kw["top"], experts=experts, fixed=fixed)
    click.echo(format_search(result))
    return result


def sweep(ctx, s: Setting, kw: dict) -> dict:
    """``--sweep N,N``: each of ``--strategies`` at each data-parallel world size (weak scaling)."""
    from distlab import plan as pp
    from distlab.parallel import Strategy
    from distlab.plan import machine as mach
    given = [k for k in _strategy_fields(kw) if _given(ctx, k)]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} with --sweep: the sweep compares the layouts of "
                          f"--strategies (now {kw['strategies']}); put it there, e.g. --strategies zero=3,bucketed")
    worlds = list(csv_ints(kw["sweep"]))
    if not worlds or min(worlds) < 1:
        raise ConfigError(f"--sweep needs positive world sizes, not {kw['sweep']!r}")
    strats = [Strategy.parse(x) for x in kw["strategies"].split(",") if x]
    limit = mach.parse_bytes(kw["device_memory"]) if kw["device_memory"] else None
    if s.cluster is not None:
        raise ConfigError("--sweep with --machine: use --search (every layout of --gpus on the machine)")
    result = pp.sweep(s.trace, s.layout, worlds, s.link, s.calibration, limit, strats)
    click.echo(pp.format_sweep(result, kw["min_efficiency"]))
    return result


def one_layout(ctx, s: Setting, kw: dict) -> dict:
    """One layout's prediction; ``--dry-run`` builds it on the meta device as rank R would, ``--timeline``
    draws the predicted step."""
    from distlab import plan as pp
    result = pp.predict(s.trace, s.layout, s.link, s.calibration, s.cluster)
    click.echo(pp.format_prediction(result))
    if kw["dry_rank"] is not None:
        if kw["num_params"] is not None:
            raise ConfigError("--dry-run builds the model: give --model or --preset, not --params")
        from distlab.cli.plan_gpu import dry_run_text
        from distlab.plan.dry_run import dry_run
        lay = s.layout
        result["dry_run"] = dry_run(s.model, s.options, s.vocab, s.shape, lay.strategy, lay.world, kw["dry_rank"],
                                    lay.global_batch, kw["optimizer"] or "sgd", lora=s.lora,
                                    attention="flash" if kw["machine"] else "math")
        click.echo(dry_run_text(result))
    if kw["timeline_out"]:
        _write_timeline(result, str(s.layout.strategy), kw["timeline_out"])
    return result


def warn_about_the_machine(s: Setting, device_memory: str | None) -> None:
    """Whose times these are: a cluster measured on another GPU or not at all, a calibration of another host, or of
    CPUs where device memory was asked about."""
    cluster, cal, path = s.cluster, s.calibration, s.calibration_path
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
