"""``distlab``: thin command line over the packages (parse, build config, call in, print).

Every command that runs on several processes takes the same launch flags: ``--nproc-per-node N``
hands off to torchrun (with its flag names); ``--rank R --world-size W --master-addr A`` starts
one rank of a manual multi-node job; under torchrun, mpirun or srun the command just runs.
"""

from __future__ import annotations

import functools
import os
import sys
import time

# c10d logs connection failures with C++ stack frames; distlab reports them as one line.
# Set TORCH_CPP_LOG_LEVEL=INFO to see them again. Must be set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import click  # noqa: E402

from distlab.errors import ConfigError, DistlabError, RankConfigError  # noqa: E402


def _csv_ints(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {value!r}") from None


def launch_options(f):
    """The flags every multi-process command shares (torchrun's names where they overlap)."""
    options = [
        click.option("--nproc-per-node", type=int, default=None,
                     help="Start N local workers through torchrun (omit under torchrun/mpirun/srun)."),
        click.option("--nnodes", default="1", show_default=True, help="Number of nodes (torchrun's N or MIN:MAX)."),
        click.option("--node-rank", type=int, default=0, show_default=True, help="This node's rank (torchrun)."),
        click.option("--master-addr", "--master-ip", "master_addr", default=None,
                     help="Address of rank 0 / node 0 (default 127.0.0.1)."),
        click.option("--master-port", type=int, default=None,
                     help="Port of rank 0 / node 0 (default: a free one on a single node, else 29500)."),
        click.option("--rdzv-endpoint", default=None, help="torchrun c10d rendezvous HOST:PORT (elastic jobs)."),
        click.option("--max-restarts", type=int, default=0, show_default=True,
                     help="Restarts of the worker group after a failure (torchrun)."),
        click.option("--rank", type=int, default=None, help="Manual start: this process's global rank."),
        click.option("--world-size", "--num-nodes", "world_size", type=int, default=None,
                     help="Manual start: total number of processes (one per node in a one-process-per-node job)."),
        click.option("--backend", default="auto", show_default=True, help="auto (nccl on GPU, else gloo), gloo, nccl, mpi."),
        click.option("--device", default="auto", show_default=True, envvar="DISTLAB_DEVICE",
                     help="auto (cuda if available), cpu or cuda; also $DISTLAB_DEVICE."),
        click.option("--comm-timeout", type=float, default=300.0, show_default=True,
                     help="Seconds before a missing or dead peer becomes an error (start-up and collectives)."),
        click.option("--threads", type=int, default=None,
                     help="Torch threads per rank (default: cores // local ranks)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _run_distributed(kw: dict, body, planned_check=None):
    """Launch through torchrun if asked, else join the job and call ``body(runtime)``."""
    from distlab import runtime
    from distlab.launch import LaunchOptions, launch

    lopts = LaunchOptions(kw.pop("nproc_per_node"), kw.pop("nnodes"), kw.pop("node_rank"), kw["master_addr"],
                          kw["master_port"], kw.pop("rdzv_endpoint"), kw.pop("max_restarts"), kw["threads"])
    manual = kw["rank"] is not None or kw["world_size"] is not None
    if lopts.nproc_per_node is not None and not runtime.under_launcher():
        if manual:
            raise ConfigError("--nproc-per-node (torchrun launch) and --rank/--world-size (manual start) "
                              "cannot be combined: use one or the other")
        runtime.check_local_devices(kw["device"], lopts.nproc_per_node)
        if planned_check:
            planned_check(lopts.planned_world_size())
        sys.exit(launch(lopts, sys.argv[1:]))
    if planned_check and manual and kw["world_size"]:
        planned_check(kw["world_size"])
    rt = runtime.init(backend=kw.pop("backend"), device=kw.pop("device"), timeout_s=kw.pop("comm_timeout"),
                      threads=kw.pop("threads"), rank=kw.pop("rank"), world_size=kw.pop("world_size"),
                      master_addr=kw.pop("master_addr"), master_port=kw.pop("master_port"))
    try:
        return body(rt)
    finally:
        runtime.shutdown()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="distlab")
def cli():
    """distlab: distributed training from first principles, measured against PyTorch's own."""


# --------------------------------------------------------------------------- train


def _default(name: str):
    """A field's default, from the one place it is set (TrainConfig or Strategy)."""
    from dataclasses import fields

    from distlab.parallel import Strategy
    from distlab.train import TrainConfig
    for cls in (TrainConfig, Strategy):
        for f in fields(cls):
            if f.name == name:
                return getattr(cls(), name)
    raise KeyError(name)


# The strategy's flags (shared by train and plan), then train's own. Each is a field of Strategy or
# TrainConfig, written once here with its help; the default comes from the dataclass.
STRATEGY_OPTIONS = [
    ("dp_sync", dict(default=None, help="Gradient sync: gather-scatter (via rank 0), allreduce (per parameter, after "
                     "backward), bucketed (overlapped with backward; the default) or ddp (torch's DDP). With --zero: "
                     "ZeRO's own reduce-scatter.")),
    ("collective", dict(help="All-reduce algorithm: native (gloo/NCCL), ring, butterfly or direct (distlab.comm).")),
    ("bucket_mb", dict(type=float, help="Bucket size in MB for --dp-sync bucketed and ddp.")),
    ("grad_accum", dict(type=int, help="Micro-batches per optimizer step (no communication until the last).")),
    ("sync_bn", dict(help="off, distlab (any device) or torch (nn.SyncBatchNorm, GPU only); statistics over the "
                     "data-parallel group.")),
    ("find_unused", dict(is_flag=True, help="Parameters without a gradient in a step count as zero.")),
    ("tp", dict(type=int, help="Tensor-parallel size: ranks that split each Linear layer (must divide the world size).")),
    ("tp_style", dict(help="megatron (column then row parallel, one all-reduce each way per block) or naive "
                      "(every layer column parallel, activations all-gathered).")),
    ("zero", dict(type=click.IntRange(0, 3), help="ZeRO stage over the data-parallel ranks: 1 shards optimizer "
                  "state, 2 also gradients, 3 also parameters.")),
]
TRAIN_OPTIONS = [
    ("model", dict(help="mlp, small-cnn, small-cnn-bn, vgg11, vgg11-bn, vgg19, vgg19-bn, resnet18.")),
    ("mlp_widths", dict(help="Hidden widths of the MLP, comma-separated.")),
    ("dataset", dict(help="fashion-mnist, mnist, cifar10, cifar100 or synthetic:CxHxW:K[:N].")),
    ("data_dir", dict(help="Where datasets are (also $DISTLAB_DATA, /usr/share/datasets).")),
    ("epochs", dict(type=int)),
    ("max_steps", dict(type=int, help="Stop after this many optimizer steps.")),
    ("global_batch_size", dict(type=int, aliases=("--batch-size",),
                               help="Samples per optimizer step over all ranks (split over the data-parallel ranks).")),
    ("lr", dict(type=float)),
    ("optimizer", dict(help="sgd, adam or adamw.")),
    ("lr_schedule", dict(help="constant, cosine or linear decay to 0.")),
    ("momentum", dict(type=float, help="SGD momentum.")),
    ("weight_decay", dict(type=float)),
    ("seed", dict(type=int)),
    ("log_every", dict(type=int, help="Log the loss every N steps (rank 0).")),
    ("eval_batch_size", dict(type=int)),
    *STRATEGY_OPTIONS,
    ("lr_scaling", dict(help="Scale --lr with the global batch: none, linear (x G/B) or sqrt (x sqrt(G/B)), "
                        "B = --base-batch-size.")),
    ("base_batch_size", dict(type=int, help="The global batch size --lr was tuned for.")),
    ("warmup_steps", dict(type=int, help="Linear LR warm-up steps.")),
    ("val_fraction", dict(type=float, help="Hold out this fraction of the training set (seeded) for validation; the "
                          "best validation loss and its model go into snapshots.")),
    ("snapshot_dir", dict(help="Write snapshots here (every --snapshot-every steps and at the end).")),
    ("snapshot_every", dict(type=int, help="Snapshot every N optimizer steps.")),
    ("keep_snapshots", dict(type=int, help="Keep the newest K snapshots.")),
    ("resume", dict(help="auto (newest good snapshot in --snapshot-dir; also the default after torchrun restarts "
                    "the workers) or a snapshot directory.")),
    ("time_budget_s", dict(default=None, help="Stop cleanly (evaluation, snapshot, summary) before this much "
                           "training time, counted across restarts: 2h, 90m, 3600s, 1h30m.")),
    ("out", dict(help="Run directory for metrics.jsonl and summary.json (default runs/MODEL-DATASET-TIME).")),
    ("progress", dict(flag_pair=True, default=None, help="Progress bar on rank 0 (default: when a terminal).")),
]


def field_options(table):
    """click options for ``(field, settings)`` rows: the flag from :func:`distlab.flags.flag`, the
    default from the dataclass unless the row gives one."""
    from distlab.flags import flag

    def decorate(f):
        for name, settings in reversed(table):
            settings = dict(settings)
            names = [flag(name), *settings.pop("aliases", ())]
            if settings.pop("flag_pair", False):
                names = [f"{flag(name)}/--no-{flag(name)[2:]}"]
            if "default" not in settings and not settings.get("is_flag"):
                value = _default(name)
                settings["default"] = ",".join(map(str, value)) if isinstance(value, tuple) else value
                settings["show_default"] = value is not None
            f = click.option(*names, name, **settings)(f)
        return f

    return decorate


def config_from_flags(kw: dict, table) -> dict:
    """Pop the table's fields from click's ``kw``, converted to the dataclass's types."""
    from distlab.train.config import parse_duration
    values = {name: kw.pop(name) for name, _ in table}
    if "mlp_widths" in values:
        values["mlp_widths"] = _csv_ints(values["mlp_widths"])
    if "time_budget_s" in values:
        values["time_budget_s"] = parse_duration(values["time_budget_s"])
    return values


@cli.command()
@field_options(TRAIN_OPTIONS)
@launch_options
def train(**kw):
    """Train a model: data parallel over every rank, or data x tensor parallel with --tp."""
    from distlab.train import TrainConfig

    values = config_from_flags(kw, TRAIN_OPTIONS)
    values["out"] = values["out"] or os.path.join(
        "runs", f"{values['model']}-{values['dataset'].replace(':', '_')}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = TrainConfig.from_flags(**values)
    device = kw["device"]

    def check(world_size: int) -> None:
        # Before any process starts: flags, the batch split and the data on disk.
        from distlab import runtime
        from distlab.data import locate
        cfg.validate(world_size)
        if cfg.strategy.sync_bn == "torch" and runtime.resolve_device(device, 0).type != "cuda":
            raise ConfigError("--sync-bn torch uses torch.nn.SyncBatchNorm, which only runs on GPUs; this run is on "
                              "the CPU: use --sync-bn distlab, which works on any device")
        if not cfg.dataset.startswith("synthetic"):
            locate(cfg.dataset, cfg.data_dir)
        if cfg.resume not in (None, "auto"):
            from distlab.train.snapshot import check_path
            check_path(cfg.resume)

    def body(rt):
        from distlab.train import Trainer
        from distlab.train.summary import print_summary
        summary = Trainer(cfg, rt).fit()
        if rt.is_main:
            print_summary(summary, cfg.out)

    _run_distributed(kw, body, check)


# --------------------------------------------------------------------------- verify


@cli.command()
@click.option("--nproc", type=int, default=2, show_default=True, help="Processes (gloo, CPU) for the distributed runs.")
@click.option("--strategy", "strategies", multiple=True,
              help="A strategy in its text form, repeatable: METHOD[:COLLECTIVE] then +accum=K, +bucket=MB, +syncbn, "
                   "+tp=N, +naive, +zero=S, +adam (e.g. bucketed:ring+accum=4, zero=3, allreduce+tp=2+naive). "
                   "Default: every --dp-sync x --collective, accum=4 for each method, syncbn, and tp=2 both styles "
                   "on an even world.")
@click.option("--steps", type=int, default=10, show_default=True, help="SGD steps per run.")
@click.option("--global-batch-size", type=int, default=None, help="Default: 12 x --nproc.")
@click.option("--json", "json_path", default=None, help="Write the records here.")
@click.option("--resume", "resume", is_flag=True,
              help="Instead: SIGKILL a worker mid-run under torchrun --max-restarts 1 and check that the resumed "
                   "run ends bitwise equal to an uninterrupted one (default strategy allreduce+adam).")
@click.option("--workdir", default=None, help="With --resume: keep both runs here (default: a temporary directory).")
def verify(nproc, strategies, steps, global_batch_size, json_path, resume, workdir):
    """Prove each strategy equals single-process training: largest parameter and loss differences."""
    import json
    import tempfile

    from distlab import verify as v
    from distlab.train.metrics import atomic_write_text
    if nproc < 1 or steps < 1:
        raise ConfigError("--nproc and --steps must be at least 1")
    if resume:
        chosen = [v.parse_strategy(s) for s in strategies] or [v.parse_strategy("allreduce+adam")]
        for s in chosen:
            v.config_for(s, nproc, steps, global_batch_size)
        click.echo(f"killing and resuming {len(chosen)} strategies on {nproc} processes, {steps} steps each ...",
                   err=True)
        with tempfile.TemporaryDirectory(prefix="distlab-verify-") as tmp:
            records = [v.verify_resume(s, nproc, steps, os.path.join(workdir or tmp, f"{i}-{s.name}"))
                       for i, s in enumerate(chosen)]
    else:
        chosen = [v.parse_strategy(s) for s in strategies] if strategies else v.default_strategies(nproc)
        for s in chosen:  # flags and batch split, before any process starts
            v.config_for(s, nproc, steps, global_batch_size)
        click.echo(f"verifying {len(chosen)} strategies on {nproc} processes, {steps} steps each ...", err=True)
        records = v.verify(chosen, nproc, steps, global_batch_size)
    click.echo(v.table(records))
    if json_path:
        atomic_write_text(json_path, json.dumps(records, indent=1) + "\n")
        click.echo(f"wrote {json_path}", err=True)
    failed = [r["strategy"] for r in records if not r["passed"]]
    if failed:
        click.echo(f"{len(failed)} strategies differ from single-process training beyond float32 rounding: "
                   f"{', '.join(failed)}", err=True)
        sys.exit(1)


# --------------------------------------------------------------------------- report


@cli.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--output", default="report.html", show_default=True, help="The HTML file to write.")
@click.option("--title", default="distlab report", show_default=True)
@click.option("--images", default=None, help="Also write every plot as a PNG file into this directory.")
def report(paths, output, title, images):
    """One self-contained HTML page (plots + tables) from run directories and bench, verify and
    plan validate JSON files."""
    from distlab.report import write_report
    inputs = write_report(list(paths), output, title, images)
    for path in inputs.images:
        click.echo(f"wrote {path}", err=True)
    for path, why in inputs.problems:
        click.echo(f"distlab: warning: {path}: {why}", err=True)
    click.echo(f"wrote {output} ({len(inputs.read)} inputs, {len(inputs.problems)} could not be used)", err=True)


# --------------------------------------------------------------------------- plan

DEFAULT_CALIBRATION = "runs/calibration.json"
PLANNED_FIELDS = ("dp_sync", "collective", "bucket_mb", "grad_accum", "tp", "zero")  # what plan's cost model reads


@cli.group(invoke_without_command=True)
@click.option("--model", default="mlp", show_default=True, help="A registered model (ignored with --params).")
@click.option("--mlp-widths", default=None, help="Hidden widths of the MLP, e.g. 1024,512.")
@click.option("--dataset", default="fashion-mnist", show_default=True, help="Gives the input shape and classes.")
@click.option("--params", "num_params", type=float, default=None,
              help="Plan for a model known only by its parameter count (e.g. 7e9) instead of --model.")
@click.option("--activation-bytes", type=float, default=0.0, show_default=True,
              help="With --params: activation bytes per sample.")
@click.option("--layers", type=int, default=24, show_default=True, help="With --params: number of equal layers.")
@click.option("--dp", type=int, default=1, show_default=True, help="Data-parallel ranks.")
@field_options([row for row in STRATEGY_OPTIONS if row[0] in PLANNED_FIELDS])
@field_options([("optimizer", dict(help="sgd, adam or adamw (sizes the optimizer state).")),
                ("momentum", dict(type=float, help="SGD momentum (0: no momentum buffer).")),
                ("global_batch_size", dict(type=int, aliases=("--global-batch",),
                                           help="Global batch, as train's; with --sweep its per-rank share at --dp "
                                                "is kept at every size (weak scaling)."))])
@click.option("--link", default="loopback", show_default=True,
              help="Each node's link: loopback (this machine) or a rate like 100mbit, 10gbit, 100gbit.")
@click.option("--latency", default=None, help="Link latency per message round, e.g. 5us or 0.1ms.")
@click.option("--burst", default=None, help="Token-bucket burst of the link (the emulated cluster's is 512kb).")
@click.option("--threads", type=int, default=None, help="Threads per rank (picks the compute calibration).")
@click.option("--calibration", default=None,
              help=f"Calibration JSON from `distlab plan calibrate` (default {DEFAULT_CALIBRATION} if it exists; "
                   "without one, memory only).")
@click.option("--sweep", default=None, help="Data-parallel world sizes to sweep, e.g. 1,8,64,512,4096 (weak scaling).")
@click.option("--strategies", default="bucketed,zero=1,zero=2,zero=3", show_default=True,
              help="With --sweep: strategies to compare, in the text form of --strategy (e.g. ddp, zero=3, "
                   "bucketed:ring+accum=2, allreduce+tp=2).")
@click.option("--device-memory", default=None, help="With --sweep: memory per device, e.g. 80GiB.")
@click.option("--min-efficiency", type=float, default=0.5, show_default=True,
              help="With --sweep: below this scaling efficiency a strategy has stopped scaling.")
@click.option("--json", "json_out", default=None, help="Also write the prediction(s) as JSON here.")
@click.pass_context
def plan(ctx, model, mlp_widths, dataset, num_params, activation_bytes, layers, dp, optimizer, momentum,
         global_batch_size, link, latency, burst, threads, calibration, sweep, strategies, device_memory,
         min_efficiency, json_out, **strategy_fields):
    """Predict time per step and memory per rank of a layout, before running it.

    \b
    distlab plan --model resnet18 --dataset cifar10 --dp 8 --zero 2 --link 10gbit
    distlab plan --params 7e9 --activation-bytes 4e6 --link 100gbit --sweep 8,64,512,4096 --device-memory 80GiB
    distlab plan calibrate runs/bench-collectives runs/bench-scaling -o runs/calibration.json
    distlab plan validate runs/bench-scaling-cluster
    """
    if ctx.invoked_subcommand is not None:
        return
    import json as _json
    import os as _os
    from distlab.data import dataset_shape
    from distlab import plan as pp
    from distlab.plan import cost, memory
    if num_params is not None:
        t = memory.generic_trace(int(num_params), activation_bytes, layers)
    else:
        shape, k = dataset_shape(dataset)
        widths = _csv_ints(mlp_widths) if mlp_widths else (512, 256)
        t = memory.trace(model, shape, k, widths=widths)
    path = calibration or (DEFAULT_CALIBRATION if _os.path.exists(DEFAULT_CALIBRATION) else None)
    cal = pp.Calibration.load(path) if path else None
    from distlab.parallel import Strategy
    lay = pp.Layout(dp=dp, strategy=Strategy(**strategy_fields), optimizer=optimizer, momentum=momentum,
                    global_batch=global_batch_size, threads=threads).check()
    net = cost.Link.parse(link, latency, burst)
    if sweep:
        worlds = list(_csv_ints(sweep))
        if not worlds or min(worlds) < 1:
            raise ConfigError(f"--sweep needs positive world sizes, not {sweep!r}")
        strats = [Strategy.parse(s) for s in strategies.split(",") if s]
        limit = cost.parse_bytes(device_memory) if device_memory else None
        result = pp.sweep(t, lay, worlds, net, cal, limit, strats)
        click.echo(pp.format_sweep(result, min_efficiency))
    else:
        result = pp.predict(t, lay, net, cal)
        click.echo(pp.format_prediction(result))
    if cal is not None:
        click.echo(f"(calibration: {path}, {cal.machine.get('host', '?')}, {cal.machine.get('date', '?')})", err=True)
    if json_out:
        from distlab.train.metrics import atomic_write_text
        atomic_write_text(json_out, _json.dumps(result, indent=1) + "\n")
        click.echo(f"wrote {json_out}", err=True)


@plan.command("calibrate")
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--output", default=DEFAULT_CALIBRATION, show_default=True)
def plan_calibrate(paths, output):
    """Fit collectives' latency and bandwidth (alpha-beta) and the compute rate from bench results.

    PATHS: `distlab bench collectives` output, run directories of one-worker training runs and
    `distlab bench scaling` output (its one-worker runs), or directories holding them."""
    from distlab import plan as pp
    cal = pp.calibrate(list(paths))
    cal.save(output)
    for name, ab in cal.collectives.items():
        click.echo(f"{name:<15} alpha {ab.alpha * 1e6:8.1f} us/round  beta {ab.beta * 1e9:7.3f} ns/byte "
                   f"({1 / ab.beta / 1e9 if ab.beta else float('inf'):.2f} GB/s)  {ab.points} points, "
                   f"median |error| {ab.median_rel_err:.1%}, max {ab.max_rel_err:.1%}")
    for c in cal.compute.values():
        click.echo(f"compute         {c.rate / 1e9:8.2f} GFLOP/s + {c.overhead * 1e3:.2f} ms/step at {c.threads} "
                   f"threads/rank  {c.points} runs, median |error| {c.median_rel_err:.1%}, max {c.max_rel_err:.1%}")
    click.echo(f"wrote {output} ({len(cal.sources)} sources)", err=True)


@plan.command("validate")
@click.argument("paths", nargs=-1, required=True)
@click.option("--calibration", default=DEFAULT_CALIBRATION, show_default=True)
@click.option("--json", "json_out", default=None, help="Write the per-run comparison here.")
@click.option("--target", type=float, default=0.2, show_default=True,
              help="Exit 1 if the median absolute step-time error is above this.")
@click.option("--min-world", type=int, default=2, show_default=True,
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


@cli.group()
def cluster():
    """An emulated multi-node cluster on this machine (network namespaces, a bridge, tc shaping; root)."""


@cluster.command("up")
@click.option("--nodes", type=int, required=True, help="Number of nodes (network namespaces).")
@click.option("--bandwidth", default="1gbit", show_default=True, help="Link rate of every node (tc rate: 100mbit, 10gbit).")
@click.option("--delay", default=None, help="One-way link latency added with netem (e.g. 0.1ms).")
@click.option("--cores-per-node", type=int, default=None, help="Pin each node's processes to this many cores.")
@click.option("--name", default="dl", show_default=True, help="Cluster name (1-6 letters/digits).")
def cluster_up(nodes, bandwidth, delay, cores_per_node, name):
    """Create K nodes on their own addresses behind one bridge, links shaped to --bandwidth."""
    from distlab import cluster as c
    made = c.up(nodes, None if bandwidth == "none" else bandwidth, delay, cores_per_node, name)
    for node in made.nodes:
        cores = f", cores {','.join(map(str, node.cores))}" if node.cores else ""
        click.echo(f"node {node.rank}: {node.addr} in netns {node.netns}{cores}")
    click.echo(f"links: {made.bandwidth or 'unshaped'}{f', delay {made.delay}' if made.delay else ''}; "
               f"master {made.master_addr}. Next: distlab cluster run --name {name} -- distlab train "
               f"--nproc-per-node 1 ...")


@cluster.command("down")
@click.option("--name", default="dl", show_default=True)
def cluster_down(name):
    """Remove everything `up` created (also after a crash)."""
    from distlab import cluster as c
    c.check_capable()
    removed = c.down(name)
    click.echo(f"removed {', '.join(removed)}" if removed else f"no cluster {name!r} was up")


@cluster.command("status")
@click.option("--name", default="dl", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the state as JSON.")
def cluster_status(name, as_json):
    """What is up: nodes, addresses, link rate."""
    import json

    from distlab import cluster as c
    state = c.status(name)
    if as_json:
        click.echo(json.dumps(state, indent=1))
    elif state is None:
        click.echo(f"no cluster {name!r} is up")
    else:
        click.echo(f"cluster {name}: {len(state['nodes'])} nodes, links {state['bandwidth'] or 'unshaped'}, "
                   f"master {state['master_addr']}")
        for node in state["nodes"]:
            click.echo(f"  node {node['rank']}: {node['addr']} netns {node['netns']}"
                       f"{'' if node['present'] else ' (MISSING)'}")


@cluster.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--name", default="dl", show_default=True)
@click.option("--timeout", type=float, default=None, help="Kill the command on every node after this many seconds.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def cluster_run(name, timeout, cmd):
    """Run CMD on every node at once (distlab commands get --node-rank/--master-addr/--nnodes)."""
    from distlab import cluster as c
    sys.exit(c.run(list(cmd), name, timeout))


# --------------------------------------------------------------------------- demo


@cli.group()
def demo():
    """Small runnable demonstrations of the building blocks."""


@demo.command("ordered-print")
@launch_options
def demo_ordered_print(**kw):
    """Every rank prints one line; the lines come out in rank order, always."""
    from distlab.demos import ordered_print_demo
    _run_distributed(kw, ordered_print_demo)


@demo.command("p2p")
@launch_options
def demo_p2p(**kw):
    """Blocking and non-blocking send/recv of a 3x4 tensor, then an all-reduce (needs 2+ ranks)."""
    from distlab.demos import p2p_demo
    _run_distributed(kw, p2p_demo)


@demo.command("sampler")
@click.option("--length", type=int, default=10, show_default=True, help="Dataset length (item i is 10*i).")
@click.option("--num-replicas", type=int, default=None, help="Replicas to show (default: the world size).")
@click.option("--shuffle/--no-shuffle", default=False, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--epoch", type=int, default=0, show_default=True)
@click.option("--drop-last/--no-drop-last", default=False, show_default=True, help="DistributedSampler drop_last.")
@click.option("--batch-size", type=int, default=2, show_default=True, help="BatchSampler batch size.")
@click.option("--batch-drop-last/--no-batch-drop-last", default=False, show_default=True,
              help="BatchSampler drop_last.")
@launch_options
def demo_sampler(**kw):
    """How DistributedSampler + BatchSampler split a dataset, and how local batches make the global one."""
    from distlab.demos import sampler_demo
    opts = {k: kw.pop(k) for k in ("length", "num_replicas", "shuffle", "seed", "epoch", "drop_last",
                                    "batch_size", "batch_drop_last")}
    _run_distributed(kw, functools.partial(sampler_demo, **opts))


# --------------------------------------------------------------------------- bench


@cli.group()
def bench():
    """Measure: every command writes DIR/SUITE.json and prints a table."""


def _float_list(value: str) -> list[int]:
    try:
        return [int(float(v)) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated numbers, got {value!r}") from None


@bench.command("collectives")
@click.option("--world", default="1,2,4,8,16,32", show_default=True, help="World sizes (processes).")
@click.option("--sizes", default="1e3,1e4,1e5,1e6", show_default=True, help="Elements per tensor.")
@click.option("--algorithms", default="native,ring,butterfly,direct,gather_scatter", show_default=True)
@click.option("--ops", default="sum", show_default=True, help="sum, avg, max, min, product.")
@click.option("--dtypes", default="float32", show_default=True, help="float32, float64, float16, bfloat16.")
@click.option("--warmup", type=int, default=3, show_default=True)
@click.option("--repeats", type=int, default=20, show_default=True, help="Timed calls per run.")
@click.option("--runs", type=int, default=1, show_default=True,
              help="Independent runs (fresh processes); times are the median of the runs' medians.")
@click.option("--out", default="runs/bench", show_default=True, help="Writes OUT/collectives.json.")
@click.option("--plot", "plot_dir", default=None, help="Also write time and busbw PNGs here.")
@click.option("--link", default=None,
              help="Launched across nodes: the link they ran over, recorded in the JSON (e.g. 1gbit).")
@click.option("--burst", default=None, help="Launched across nodes: the links' token-bucket burst, recorded.")
@launch_options
def bench_collectives(world, sizes, algorithms, ops, dtypes, warmup, repeats, runs, out, plot_dir, link, burst, **kw):
    """All-reduce algorithms vs torch's native one: time, bandwidth, accuracy, bytes, memory.

    Spawns its own ranks on this machine (one run per --world size); launched like training
    (--nproc-per-node with --nnodes ..., or under torchrun / `distlab cluster run`), it measures the
    group it was started in instead -- across the nodes' real links."""
    from distlab import comm, runtime
    from distlab.bench import collectives
    from distlab.comm.ops import OPS
    worlds = _float_list(world)
    if not worlds or min(worlds) < 1 or repeats < 1 or warmup < 0 or runs < 1:
        raise ConfigError("--world needs positive sizes, --repeats and --runs at least 1, --warmup at least 0")
    op_list = [o for o in ops.split(",") if o]
    for o in op_list:
        if o not in OPS:
            raise ConfigError(f"unknown op {o!r}; choose from {', '.join(OPS)}")
    for d in dtypes.split(","):
        if d not in collectives.DTYPES:
            raise ConfigError(f"unknown dtype {d!r}; choose from {', '.join(collectives.DTYPES)}")
    for a in algorithms.split(","):
        comm.check_algorithm(a)
    launched = kw["nproc_per_node"] is not None or kw["rank"] is not None or runtime.under_launcher()
    if launched:
        kw["threads"] = kw["threads"] or 1

        def body(rt):
            records = collectives.run_here(rt.rank, rt.world_size, _float_list(sizes), algorithms.split(","),
                                           op_list, dtypes.split(","), warmup, repeats,
                                           runs, out, link, burst)
            if records is not None:
                click.echo(collectives.table(records))
                click.echo(f"wrote {out}/collectives.json", err=True)

        _run_distributed(kw, body)
        return
    records = collectives.run(worlds, _float_list(sizes), algorithms.split(","), op_list, dtypes.split(","),
                              warmup, repeats, out, progress=lambda s: click.echo(s, err=True), runs=runs)
    click.echo(collectives.table(records))
    for w, numel in collectives.crossovers(records).items():
        click.echo(f"world {w}: ring faster than butterfly "
                   + (f"from {numel:,} elements up" if numel else "at no size measured"))
    click.echo(f"wrote {out}/collectives.json", err=True)
    if plot_dir:
        for path in collectives.plot(records, plot_dir):
            click.echo(f"wrote {path}", err=True)


@bench.command("syncbn")
@click.option("--workers", default="1,2,4", show_default=True, help="Process counts.")
@click.option("--features", default="128,256,512,1024", show_default=True)
@click.option("--batches", default="32,64", show_default=True, help="Global batch sizes.")
@click.option("--warmup", type=int, default=5, show_default=True)
@click.option("--repeats", type=int, default=50, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (torch's SyncBN needs cuda).")
@click.option("--out", default="runs/bench", show_default=True, help="Writes OUT/syncbn.json.")
@click.option("--plot", "plot_dir", default=None, help="Also write time-vs-features PNGs here.")
def bench_syncbn(workers, features, batches, warmup, repeats, device, out, plot_dir):
    """SyncBatchNorm (distlab's, torch's on GPU) vs local BatchNorm: accuracy, time, memory."""
    from distlab.bench import syncbn
    if repeats < 1 or warmup < 0:
        raise ConfigError("--repeats must be at least 1 and --warmup at least 0")
    records = syncbn.run(_csv_ints(workers), _csv_ints(features), _csv_ints(batches), warmup=warmup,
                         repeats=repeats, device=device, out=out, progress=lambda s: click.echo(s, err=True))
    click.echo(syncbn.table(records))
    click.echo(f"wrote {out}/syncbn.json", err=True)
    for path in syncbn.plot(records, plot_dir) if plot_dir else []:
        click.echo(f"wrote {path}", err=True)


@bench.command("dp")
@click.option("--workloads", default="mlp,vgg11,resnet18-syncbn", show_default=True)
@click.option("--nproc", type=int, default=2, show_default=True)
@click.option("--steps", type=int, default=30, show_default=True)
@click.option("--batch", type=int, default=64, show_default=True, help="Global batch size.")
@click.option("--methods", default="gather-scatter,allreduce,allreduce:ring,bucketed,bucketed:ring,ddp",
              show_default=True, help="Strategies (text form, e.g. bucketed:ring+accum=2), comma-separated.")
@click.option("--runs", type=int, default=1, show_default=True, help="Repeat each configuration; median of medians.")
@click.option("--data-dir", default=None)
@click.option("--out", default="runs/bench", show_default=True, help="Writes OUT/dp.json.")
@click.option("--plot", "plot_dir", default=None, help="Also write samples/s bar charts here.")
def bench_dp(workloads, nproc, steps, batch, methods, runs, data_dir, out, plot_dir):
    """Every --dp-sync method vs DDP on real training: samples/s, bytes/step, memory, accuracy."""
    from distlab.bench import dp
    names = [w for w in workloads.split(",") if w]
    for w in names:
        if w not in dp.WORKLOADS:
            raise ConfigError(f"unknown workload {w!r}; choose from {', '.join(dp.WORKLOADS)}")
    if nproc < 2 or steps < 3 or runs < 1:
        raise ConfigError("--nproc must be at least 2, --steps at least 3 and --runs at least 1")
    chosen = _strategies(methods, nproc, batch)
    records = dp.run(names, nproc, steps, batch, chosen, runs, data_dir, out, progress=lambda s: click.echo(s, err=True))
    click.echo(dp.table(records))
    click.echo(f"wrote {out}/dp.json", err=True)
    for path in dp.plot(records, plot_dir) if plot_dir else []:
        click.echo(f"wrote {path}", err=True)


@bench.command("scaling")
@click.option("--world", default="1,2,4", show_default=True, help="Worker counts.")
@click.option("--modes", default="weak,strong", show_default=True,
              help="weak (fixed per-worker batch) and/or strong (fixed global batch).")
@click.option("--methods", default="ddp", show_default=True,
              help="Strategies to compare (text form: ddp, bucketed:ring, allreduce+accum=2 ...), comma-separated.")
@click.option("--per-worker-batch", type=int, default=32, show_default=True, help="Weak scaling: batch per worker.")
@click.option("--global-batch", type=int, default=128, show_default=True, help="Strong scaling: global batch.")
@click.option("--model", default="mlp", show_default=True)
@click.option("--mlp-widths", default=None, help="Hidden widths of the MLP (default: the model's).")
@click.option("--dataset", default="fashion-mnist", show_default=True)
@click.option("--data-dir", default=None)
@click.option("--epochs", type=int, default=1, show_default=True)
@click.option("--max-steps", type=int, default=None, help="Cap every run at this many steps.")
@click.option("--optimizer", default="adam", show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True, help="LR at the per-worker batch (weak) / global batch (strong).")
@click.option("--lr-scaling", default="sqrt", show_default=True, help="Weak scaling LR rule: none, linear, sqrt.")
@click.option("--val-fraction", type=float, default=0.1, show_default=True)
@click.option("--cluster", is_flag=True, help="Run multi-worker runs on an emulated cluster, one node per worker (root).")
@click.option("--bandwidths", default="100mbit,1gbit,10gbit", show_default=True, help="With --cluster: link rates.")
@click.option("--out", default="runs/bench-scaling", show_default=True, help="Writes OUT/scaling.json and OUT/runs/.")
@click.option("--plot", "plot_dir", default=None, help="Also write loss-vs-time and efficiency PNGs here.")
def bench_scaling(world, modes, methods, per_worker_batch, global_batch, model, mlp_widths, dataset, data_dir,
                  epochs, max_steps, optimizer, lr, lr_scaling, val_fraction, cluster, bandwidths, out, plot_dir):
    """Weak and strong scaling over 1, 2, 4 workers (or emulated nodes): time per epoch, accuracy, efficiency."""
    from distlab.bench import scaling
    from distlab.parallel import Strategy
    from distlab.train.config import LR_SCALINGS
    worlds = list(_csv_ints(world))
    mode_list = [m for m in modes.split(",") if m]
    method_list = [m for m in methods.split(",") if m]
    if not worlds or min(worlds) < 1:
        raise ConfigError(f"--world needs positive worker counts, not {world!r}")
    if not mode_list or set(mode_list) - {"weak", "strong"}:
        raise ConfigError(f"--modes: weak and/or strong, not {modes!r}")
    if not method_list:
        raise ConfigError("--methods: give at least one strategy")
    for m in method_list:
        Strategy.parse(m).check(max(worlds))
    if lr_scaling not in LR_SCALINGS:
        raise ConfigError(f"--lr-scaling {lr_scaling!r}: choose one of {', '.join(LR_SCALINGS)}")
    if 1 not in worlds:
        worlds = [1] + worlds  # efficiency is relative to one worker
    links = [b for b in bandwidths.split(",") if b] if cluster else [None]
    records = scaling.run(worlds, mode_list, method_list, per_worker_batch, global_batch, model, dataset, data_dir,
                          epochs, max_steps, optimizer, lr, lr_scaling, val_fraction, links, cluster, out,
                          progress=lambda s: click.echo(s, err=True), mlp_widths=mlp_widths)
    click.echo(scaling.table(records))
    click.echo(f"wrote {out}/scaling.json", err=True)
    for path in scaling.plot(records, plot_dir) if plot_dir else []:
        click.echo(f"wrote {path}", err=True)


@bench.command("parallel")
@click.option("--workloads", default="mlp,wide-mlp", show_default=True, help="mlp (512,256) and wide-mlp (4096,4096).")
@click.option("--strategies", default=",".join(("dp", "zero1", "zero2", "zero3", "tp-naive", "tp-megatron", "dp2xtp",
                                                 "torch-zero1", "torch-fsdp2", "torch-tp")), show_default=True,
              help="Short names (dp, zero1-3, tp-naive, tp-megatron: tp = --nproc, dp2xtp), any strategy text "
                   "(e.g. bucketed:ring, allreduce+tp=2+zero=1), and torch's torch-zero1, torch-fsdp2, torch-tp.")
@click.option("--nproc", type=int, default=4, show_default=True)
@click.option("--steps", type=int, default=20, show_default=True)
@click.option("--batch", type=int, default=64, show_default=True, help="Global batch size.")
@click.option("--dataset", default="fashion-mnist", show_default=True)
@click.option("--data-dir", default=None)
@click.option("--out", default="runs/bench", show_default=True, help="Writes OUT/parallel.json.")
def bench_parallel(workloads, strategies, nproc, steps, batch, dataset, data_dir, out):
    """DP, ZeRO-1/2/3, tensor parallel and DP x TP beside torch's ZeRO, FSDP2 and DTensor TP."""
    from distlab.bench import parallel
    names = [w for w in workloads.split(",") if w]
    chosen = [s for s in strategies.split(",") if s]
    for w in names:
        if w not in parallel.WORKLOADS:
            raise ConfigError(f"unknown workload {w!r}; choose from {', '.join(parallel.WORKLOADS)}")
    if nproc < 2 or nproc % 2 or steps < 3:
        raise ConfigError("--nproc must be an even number >= 2 (tensor parallel pairs) and --steps at least 3")
    for s in chosen:
        if s not in parallel.TORCH:
            strategy = parallel.strategy_for(s, nproc)
            parallel.config(strategy, parallel.WORKLOADS[names[0]], steps, batch, dataset).validate(nproc)
    records = parallel.run(names, chosen, nproc, steps, batch, dataset, data_dir, out,
                           progress=lambda s: click.echo(s, err=True))
    click.echo(parallel.table(records))
    click.echo(f"wrote {out}/parallel.json", err=True)


def _strategies(text: str, world: int, batch: int):
    """Comma-separated strategy texts, each checked against the world size and global batch."""
    from distlab.parallel import Strategy
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        strategy = Strategy.parse(part).check(world)
        strategy.check_batch(batch, world)
        out.append(strategy)
    if not out:
        raise ConfigError("no strategy given")
    return out


@bench.command("markdown")
@click.argument("paths", nargs=-1, required=True)
def bench_markdown(paths):
    """Print README-ready Markdown tables from bench JSON files."""
    from distlab.bench import markdown
    for p in paths:
        try:
            click.echo(markdown.render(p) + "\n")
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"cannot make a table from {p}: {exc}") from None


# --------------------------------------------------------------------------- doctor


@cli.command()
@click.option("--data-dir", default=None, help="Also look for datasets here.")
def doctor(data_dir):
    """What this machine offers: torch, backends, devices, cores, datasets."""
    from distlab.doctor import report
    click.echo(report(data_dir))


# --------------------------------------------------------------------------- entry point


def _report_error(exc: DistlabError) -> None:
    from distlab.runtime import detect_launch
    try:
        rank = detect_launch().rank
    except DistlabError:
        rank = 0
    if rank != 0 and isinstance(exc, ConfigError) and not isinstance(exc, RankConfigError):
        return  # every rank finds the same config error; rank 0 says it once
    from distlab.flags import flagify
    prefix = f"[rank {rank}] " if rank else ""
    print(f"distlab: error: {prefix}{flagify(str(exc))}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="distlab", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        sys.exit(130)
    except DistlabError as exc:
        _report_error(exc)
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)
