"""What several commands share: launch flags, the machinery of the strategy and training flags (one row
per config field in :mod:`distlab.cli.flag_tables`, the default read from the dataclass), and small parsers."""

from __future__ import annotations

import math
import sys

import click

from distlab.errors import ConfigError


COUNT = click.IntRange(min=1)  # how many of something: at least one
NONNEGATIVE = click.IntRange(min=0)


class Number(click.ParamType):
    """A finite float within bounds (click's FloatRange lets nan through every comparison)."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False):
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        below = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        above = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if below or above:
            lo = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
            hi = "" if self.high is None else f"{'<' if self.high_open else '<='} {self.high:g}"
            self.fail(f"{value} is not {' and '.join(x for x in (lo, hi) if x)}", param, ctx)
        return number


SECONDS = Number(0.0, 1e6, low_open=True)  # a timeout: more than 0, at most ~11 days


def device_name(ctx, param, value):
    """click callback: a device name distlab knows (auto, cpu, cuda)."""
    from distlab.runtime import DEVICES
    if value is not None and value not in DEVICES:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(DEVICES)}")
    return value


def writable_dir(ctx, param, value):
    """click callback: a directory this command may write into (made later; checked now)."""
    from distlab.train.lock import check_writable
    if value is not None:
        if not str(value).strip():
            raise click.BadParameter("is empty: give a directory")
        check_writable(value, param.opts[-1].lstrip("-"))
    return value


def name_list(ctx, param, value):
    """click callback: comma-separated names, at least one -> a list."""
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    if not names:
        raise click.BadParameter(f"names nothing ({value!r}): give at least one, comma-separated")
    return names


def output_file(ctx, param, value):
    """click callback: a file this command will write (not a directory; its directory writable)."""
    from pathlib import Path
    from distlab.train.lock import check_writable
    if value is not None:
        path = Path(value)
        if not str(value).strip() or path.name in ("", ".", "..") or path.is_dir():
            raise click.BadParameter(f"{value!r} is a directory, not a file to write" if path.is_dir() and
                                     str(value).strip() else "is empty: give a file name")
        check_writable(path.parent if str(path.parent) else ".", param.opts[-1].lstrip("-"))
    return value


def csv_ints(value: str) -> tuple[int, ...]:
    """Comma-separated positive integers (widths, counts, sizes), at least one."""
    try:
        numbers = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"expected comma-separated positive integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise ConfigError(f"expected comma-separated positive integers, got {value!r}")
    return numbers


def float_list(value: str) -> list[int]:
    """Comma-separated positive counts, written as numbers (``1e6``), at least one."""
    try:
        numbers = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated numbers, got {value!r}") from None
    if not numbers or not all(math.isfinite(n) and 1 <= n <= 1e12 for n in numbers):
        raise ConfigError(f"expected comma-separated counts from 1 to 1e12 (e.g. 1e3,1e6), got {value!r}")
    return [int(n) for n in numbers]


def launch_options(f):
    """The flags every multi-process command shares (torchrun's names where they overlap)."""
    options = [
        click.option("--nproc-per-node", type=COUNT, default=None,
                     help="Start N local workers through torchrun (omit under torchrun/mpirun/srun)."),
        click.option("--nnodes", default="1", show_default=True, help="Number of nodes (torchrun's N or MIN:MAX)."),
        click.option("--node-rank", type=NONNEGATIVE, default=0, show_default=True, help="This node's rank (torchrun)."),
        click.option("--master-addr", "--master-ip", "master_addr", default=None,
                     help="Address of rank 0 / node 0 (default 127.0.0.1)."),
        click.option("--master-port", type=click.IntRange(1, 65535), default=None,
                     help="Port of rank 0 / node 0 (default: a free one on a single node, else 29500)."),
        click.option("--rdzv-endpoint", default=None, help="torchrun c10d rendezvous HOST:PORT (elastic jobs)."),
        click.option("--local-addr", default=None,
                     help="This node's address as the other nodes reach it (torchrun; elastic jobs)."),
        click.option("--rdzv-conf", default=None,
                     help="torchrun rendezvous settings, e.g. last_call_timeout=5,join_timeout=300 (elastic jobs)."),
        click.option("--max-restarts", type=NONNEGATIVE, default=0, show_default=True,
                     help="Restarts of the worker group after a failure (torchrun)."),
        click.option("--rank", type=NONNEGATIVE, default=None, help="Manual start: this process's global rank."),
        click.option("--world-size", "--num-nodes", "world_size", type=COUNT, default=None,
                     help="Manual start: total number of processes (one per node in a one-process-per-node job)."),
        click.option("--backend", default="auto", show_default=True, help="auto (nccl on GPU, else gloo), gloo, nccl, mpi."),
        click.option("--device", default="auto", show_default=True, envvar="DISTLAB_DEVICE", callback=device_name,
                     help="auto (cuda if available), cpu or cuda; also $DISTLAB_DEVICE."),
        click.option("--comm-timeout", type=SECONDS, default=300.0, show_default=True,
                     help="Seconds a collective waits for a dead or hung peer before it becomes an error."),
        click.option("--init-timeout", type=SECONDS, default=None,
                     help="Seconds start-up waits for every rank to arrive (default: --comm-timeout); waiting "
                          "ranks say so every ~10 s."),
        click.option("--threads", type=COUNT, default=None,
                     help="Torch threads per rank (default: cores // local ranks)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def check_addresses(lopts) -> None:
    """Before a launch: the node count, node rank and every address are well formed and resolve."""
    from distlab.runtime.launch import check_host
    worlds = lopts.possible_world_sizes()  # --nnodes N or MIN:MAX
    if not lopts.elastic and lopts.node_rank >= lopts.max_nodes:
        raise ConfigError(f"--node-rank {lopts.node_rank} with --nnodes {lopts.nnodes}: node ranks go from 0 to "
                          f"{lopts.max_nodes - 1}")
    if lopts.rdzv_endpoint is not None:
        host, colon, port = lopts.rdzv_endpoint.rpartition(":")
        host = host if colon else lopts.rdzv_endpoint
        if colon and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError(f"--rdzv-endpoint {lopts.rdzv_endpoint!r}: write HOST:PORT with a port from 1 to 65535")
        if not host:
            raise ConfigError(f"--rdzv-endpoint {lopts.rdzv_endpoint!r}: write HOST:PORT")
        check_host("--rdzv-endpoint", host.strip("[]"))
    for flag, host in (("--master-addr", lopts.master_addr), ("--local-addr", lopts.local_addr)):
        if host is not None:
            check_host(flag, host)
    if lopts.rdzv_conf is not None and not all("=" in item for item in lopts.rdzv_conf.split(",")):
        raise ConfigError(f"--rdzv-conf {lopts.rdzv_conf!r}: write KEY=VALUE pairs separated by commas, e.g. "
                          f"last_call_timeout=5,join_timeout=300")
    return worlds


def run_distributed(kw: dict, body, planned_check=None, prelaunch=None):
    """Launch through torchrun if asked (after ``planned_check`` for each world size the launch may have,
    then ``prelaunch()``; what it returns is called when the launch ends), else join the job: ``body(runtime)``."""
    from distlab import runtime
    from distlab.launch.torchrun import LaunchOptions, launch

    lopts = LaunchOptions(kw.pop("nproc_per_node"), kw.pop("nnodes"), kw.pop("node_rank"), kw["master_addr"],
                          kw["master_port"], kw.pop("rdzv_endpoint"), kw.pop("max_restarts"), kw["threads"],
                          kw.pop("rdzv_conf"), kw.pop("local_addr"))
    manual = kw["rank"] is not None or kw["world_size"] is not None
    if lopts.nproc_per_node is not None and not runtime.under_launcher():
        if manual:
            raise ConfigError("--nproc-per-node (torchrun launch) and --rank/--world-size (manual start) "
                              "cannot be combined: use one or the other")
        check_addresses(lopts)
        runtime.check_local_devices(kw["device"], lopts.nproc_per_node)
        device = runtime.resolve_device(kw["device"], 0)
        runtime.resolve_backend(kw["backend"], device)  # once, before any worker
        if device.type == "cpu":
            runtime.hide_gpus()  # the workers' torch defaults to the CPU too (DDP hooks, device meshes)
        if planned_check:  # an elastic job may run at any world size of its range: each must work
            for world in lopts.possible_world_sizes():
                planned_check(world)
        release = prelaunch() if prelaunch else None
        try:
            code = launch(lopts, sys.argv[1:])
        finally:
            if release:  # held while the workers ran; this process may go on (distlab.cli.main called from Python)
                release()
        sys.exit(code)
    if planned_check and manual and kw["world_size"]:
        planned_check(kw["world_size"])
    elif planned_check and not manual and not runtime.under_launcher():
        planned_check(1)  # one process: the same checks before any work
    rt = runtime.init(backend=kw.pop("backend"), device=kw.pop("device"), timeout_s=kw.pop("comm_timeout"),
                      init_timeout_s=kw.pop("init_timeout"),
                      threads=kw.pop("threads"), rank=kw.pop("rank"), world_size=kw.pop("world_size"),
                      master_addr=kw.pop("master_addr"), master_port=kw.pop("master_port"))
    try:
        return body(rt)
    finally:
        runtime.shutdown()


def default_of(name: str):
    """A field's default, from the one place it is set (TrainConfig or Strategy)."""
    from dataclasses import fields

    from distlab.parallel import Strategy
    from distlab.train import TrainConfig
    for cls in (TrainConfig, Strategy):
        for f in fields(cls):
            if f.name == name:
                return getattr(cls(), name)
    raise KeyError(name)


def field_options(table):
    """click options for ``(field, settings)`` rows: the flag from :func:`distlab.tools.flags.flag`, the
    default from the dataclass unless the row gives one."""
    from distlab.tools.flags import flag

    def decorate(f):
        for name, settings in reversed(table):
            settings = dict(settings)
            names = [flag(name), *settings.pop("aliases", ())]
            if settings.pop("flag_pair", False):
                names = [f"{flag(name)}/--no-{flag(name)[2:]}"]
            if "default" not in settings and not settings.get("is_flag"):
                value = default_of(name)
                settings["default"] = ",".join(map(str, value)) if isinstance(value, tuple) else value
                settings["show_default"] = value is not None
            f = click.option(*names, name, **settings)(f)
        return f

    return decorate


def model_options_of(model: str, kw: dict):
    """Pop the model flags (:data:`MODEL_OPTIONS`) from click's ``kw``: ``model``'s options object from the
    ones given (None where none is: the family's defaults); one line naming a flag ``model`` does not take."""
    from distlab.cli.flag_tables import CSV_OPTIONS, MODEL_OPTIONS
    from distlab.models import options_from
    given = {name: kw.pop(name) for name, _ in MODEL_OPTIONS}
    given = {k: csv_ints(v) if k in CSV_OPTIONS else v for k, v in given.items() if v is not None}
    return options_from(model, given) if given else None


def config_from_flags(kw: dict, table) -> dict:
    """Pop the table's fields from click's ``kw``, converted to the dataclass's types."""
    from distlab.cli.flag_tables import CSV_OPTIONS, MODEL_OPTIONS
    from distlab.train.config import parse_duration
    values = {name: kw.pop(name) for name, _ in table}
    for name, _ in MODEL_OPTIONS:
        if name in CSV_OPTIONS and values.get(name) is not None:
            values[name] = csv_ints(values[name])
    if "model_args" in values:
        values["model_args"] = tuple(values["model_args"])
    if values.get("pp_balance") is not None:
        values["pp_balance"] = csv_ints(values["pp_balance"])
    if "time_budget_s" in values:
        values["time_budget_s"] = parse_duration(values["time_budget_s"])
    return values
