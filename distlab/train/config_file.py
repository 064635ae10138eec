"""A run's settings as a file: ``OUT/config.toml`` (every setting of what is trained, flat, as the
flags are) and ``distlab train --config FILE`` reading one back -- one line naming the file and the
key for anything wrong; where a run writes is refused (only the command line says it)."""

from __future__ import annotations

import re
from dataclasses import fields

from distlab.errors import ConfigError, did_you_mean, first_line
from distlab.models import specs
from distlab.parallel import Strategy
from distlab.train.config import TrainConfig, parse_duration


def config_file_text(cfg) -> str:
    """This config as a TOML file ``distlab train --config`` reads: every setting of what is trained,
    flat (the strategy's fields beside the others, as the flags are), not where its outputs go."""
    import tomli_w
    flat = {**{k: v for k, v in cfg.to_dict().items() if k != "strategy"}, **cfg.strategy.to_dict()}
    flat = {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()
            if v is not None and k not in RUN_PLACE}
    return "# distlab train --config this file (flags given beside it override it)\n" + tomli_w.dumps(flat)


def read_config_file(path: str) -> dict:
    """A ``--config`` file's settings by field name (lists as tuples); one line naming the file and
    the key for anything wrong. Keys are the flags' names with underscores (``model_arg``,
    ``time_budget`` and ``batch_size`` as the flags spell them, or the fields' own names); where a
    run writes (:data:`COMMAND_LINE_ONLY`) is refused: a file copied from another run must not write
    into that run's directories."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"--config {path} is not TOML: {first_line(exc, 160)}") from None
    except RecursionError:
        raise ConfigError(f"--config {path} is nested too deeply to be a settings file (distlab's are flat: "
                          f"key = value)") from None
    types = {f.name: str(f.type) for owner in (TrainConfig, Strategy) for f in fields(owner)
             if f.name not in ("strategy", "options")}
    types |= {f.name: str(f.type) for family in specs() for f in fields(family.options)}
    out = {}
    for written, value in values.items():
        key = CONFIG_ALIASES.get(written.replace("-", "_"), written.replace("-", "_"))
        if key in COMMAND_LINE_ONLY:
            raise ConfigError(f"--config {path}: {written} is where a run writes or what it resumes, which only "
                              f"the command line says (--{key.replace('_', '-')}), so a settings file copied "
                              f"from another run never writes into its directories: remove it from the file")
        if key in LAUNCH_SETTINGS:
            raise ConfigError(f"--config {path}: {written} is a launch setting -- how many processes, where, on "
                              f"which device, with how many threads -- not a training setting the file holds: "
                              f"pass --{key.replace('_', '-')} on the command line beside --config")
        if key not in types:
            hint = did_you_mean(written, [*types, *CONFIG_ALIASES], CONFIG_SYNONYMS)
            raise ConfigError(f"--config {path}: unknown setting {written!r}{hint} (the file's keys are the "
                              f"flags' names with underscores, e.g. global_batch_size)")
        if key == "time_budget_s" and isinstance(value, str):
            value = parse_duration(value)
        if not _of_type(value, types[key]):
            raise ConfigError(f"--config {path}: {written} = {value!r} is not a {types[key].replace(' | None', '')}")
        if key in out:
            raise ConfigError(f"--config {path}: {key} is set twice (as {written} and another spelling)")
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


# where and how a run writes, not what it trains: not in config_file_text
RUN_PLACE = ("out", "resume", "snapshot_dir", "snapshot_every", "snapshot_async", "keep_snapshots", "tensorboard",
             "trace", "profile")
COMMAND_LINE_ONLY = ("out", "resume", "snapshot_dir", "tensorboard")  # refused in a --config file
# how and where the processes start (the launcher's flags, not TrainConfig's): refused in a --config file
LAUNCH_SETTINGS = ("threads", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint",
                   "local_addr", "rdzv_conf", "max_restarts", "rank", "world_size", "num_nodes", "master_ip",
                   "backend", "device", "comm_timeout", "init_timeout")
CONFIG_ALIASES = {"model_arg": "model_args", "time_budget": "time_budget_s", "batch_size": "global_batch_size"}
CONFIG_SYNONYMS = {"learning_rate": "lr", "lr_rate": "lr", "steps": "max_steps", "num_steps": "max_steps",
                   "num_epochs": "epochs", "grad_accumulation": "grad_accum", "gradient_accumulation_steps": "grad_accum",
                   "zero_stage": "zero", "warmup": "warmup_steps", "n_heads": "n_head", "n_layers": "n_layer",
                   "lr_scheduler": "lr_schedule", "optim": "optimizer", "data": "dataset"}


def _of_type(value, annotation: str) -> bool:
    """Whether a TOML value fits a field annotated ``annotation`` (``int | None``, ``tuple[int, ...]`` ...)."""
    words = set(re.findall(r"[a-z]+", annotation))
    if isinstance(value, bool):
        return "bool" in words
    if isinstance(value, int):
        return bool(words & {"int", "float"})
    if isinstance(value, float):
        return "float" in words
    if isinstance(value, str):
        return "str" in words
    if isinstance(value, list):
        inner = set(re.findall(r"[a-z]+", annotation.partition("[")[2]))
        return "tuple" in words and all(_of_type(v, " ".join(inner)) for v in value)
    return False
