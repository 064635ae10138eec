"""Training configuration: one dataclass, validated once, with the numbers in the messages."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from distlab.data import canonical_name
from distlab.errors import ConfigError
from distlab.models import check_model_name
from distlab.parallel import COLLECTIVES, SYNC_BN, SYNC_METHODS, TP_STYLES, ZERO_STAGES
from distlab.parallel.mesh import layout

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine", "linear")
LR_SCALINGS = ("none", "linear", "sqrt")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float | None) -> float | None:
    """``"2h"``, ``"90m"``, ``"3600s"``, ``"1h30m"`` or a number of seconds -> seconds."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else float(text)
    value = text.strip().lower()
    try:
        return float(value)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd])", value)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd])", "", value).strip():
        raise ConfigError(f"cannot read the duration {text!r}: write e.g. 2h, 90m, 3600s or 1h30m")
    return sum(float(n) * _UNITS[u] for n, u in parts)


@dataclass
class TrainConfig:
    model: str = "mlp"
    mlp_widths: tuple[int, ...] = (512, 256)
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    epochs: int = 1
    max_steps: int | None = None
    global_batch_size: int = 64
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "cosine"
    seed: int = 0
    log_every: int = 20
    eval_batch_size: int = 1000
    eval_every_epoch: bool = True
    dp_sync: str = "allreduce"
    collective: str = "native"
    bucket_mb: float = 25.0
    find_unused: bool = False
    grad_accum: int = 1
    sync_bn: str = "off"
    tp: int = 1
    tp_style: str = "megatron"
    zero: int = 0
    lr_scaling: str = "none"
    base_batch_size: int | None = None
    warmup_steps: int = 0
    val_fraction: float = 0.0
    snapshot_dir: str | None = None
    snapshot_every: int | None = None
    keep_snapshots: int = 3
    resume: str | None = None  # "auto" or a snapshot directory
    time_budget_s: float | None = None
    out: str | None = None
    progress: bool | None = None  # None: on when stderr is a terminal
    verbose: bool = True  # rank 0 prints a line per log step and evaluation
    timing_warmup_steps: int = 5
    extra: dict = field(default_factory=dict)

    def validate(self, world_size: int) -> "TrainConfig":
        """Check every flag against the others and the world size; raise ConfigError naming numbers."""
        check_model_name(self.model)
        self.dataset = canonical_name(self.dataset)
        if self.dp_sync not in SYNC_METHODS:
            raise ConfigError(f"unknown --dp-sync {self.dp_sync!r}; choose one of: {', '.join(SYNC_METHODS)}")
        if self.collective not in COLLECTIVES:
            raise ConfigError(f"unknown --collective {self.collective!r}; choose one of: {', '.join(COLLECTIVES)}")
        if self.dp_sync == "gather-scatter" and self.collective != "native":
            raise ConfigError(f"--dp-sync gather-scatter is its own communication pattern (through rank 0) and "
                              f"cannot use --collective {self.collective}; drop --collective or pick another --dp-sync")
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"--zero {self.zero}: choose 0 (off), 1, 2 or 3")
        if self.zero and self.dp_sync != "allreduce":
            raise ConfigError(f"--zero {self.zero} does its own gradient sync (reduce-scatter to each shard's owner), "
                              f"so --dp-sync {self.dp_sync} cannot apply: drop --dp-sync or use --zero 0")
        if self.zero and self.find_unused:
            raise ConfigError("--find-unused is implied by --zero (parameters without a gradient count as zero): "
                              "drop --find-unused")
        if self.sync_bn not in SYNC_BN:
            raise ConfigError(f"unknown --sync-bn {self.sync_bn!r}; choose one of: {', '.join(SYNC_BN)}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"--bucket-mb must be positive, not {self.bucket_mb}")
        if self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be at least 1, not {self.grad_accum}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown --optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown --lr-schedule {self.lr_schedule!r}; choose one of: {', '.join(LR_SCHEDULES)}")
        if self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be positive, not {self.global_batch_size}")
        if self.tp_style not in TP_STYLES:
            raise ConfigError(f"unknown --tp-style {self.tp_style!r}; choose one of: {', '.join(TP_STYLES)}")
        layout(world_size, self.tp)  # --tp must divide the world size
        dp = world_size // self.tp  # data-parallel ranks: each holds a shard of the global batch
        what = f"world size {dp}" if self.tp == 1 else f"the data-parallel size {dp} (world {world_size} / --tp {self.tp})"
        if self.global_batch_size % dp:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} is not divisible by {what}: "
                              f"use a multiple of {dp} (e.g. {dp * max(1, self.global_batch_size // dp)})")
        unit = dp * self.grad_accum
        if self.global_batch_size % unit:
            ranks = f"{dp} data-parallel ranks" if self.tp > 1 else f"{world_size} ranks"
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} must split into --grad-accum {self.grad_accum} equal "
                f"micro-batches on each of {ranks}: use a multiple of {unit} "
                f"(e.g. {unit * max(1, self.global_batch_size // unit)})")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1, not {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps must be at least 1, not {self.max_steps}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, not {self.lr}")
        if self.log_every < 1:
            raise ConfigError(f"--log-every must be at least 1, not {self.log_every}")
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(f"unknown --lr-scaling {self.lr_scaling!r}; choose one of: {', '.join(LR_SCALINGS)}")
        if self.lr_scaling != "none" and not self.base_batch_size:
            raise ConfigError(f"--lr-scaling {self.lr_scaling} scales --lr from the batch size it was tuned for: "
                              f"give that as --base-batch-size (e.g. --base-batch-size {self.global_batch_size})")
        if self.base_batch_size is not None and self.base_batch_size < 1:
            raise ConfigError(f"--base-batch-size must be positive, not {self.base_batch_size}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be at least 0, not {self.warmup_steps}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction must be in [0, 1), not {self.val_fraction}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ConfigError(f"--snapshot-every must be at least 1 step, not {self.snapshot_every}")
        if self.snapshot_every and not self.snapshot_dir:
            raise ConfigError("--snapshot-every needs --snapshot-dir (where to write the snapshots)")
        if self.keep_snapshots < 1:
            raise ConfigError(f"--keep-snapshots must be at least 1, not {self.keep_snapshots}")
        if self.resume == "auto" and not self.snapshot_dir:
            raise ConfigError("--resume auto picks the newest snapshot in --snapshot-dir: give --snapshot-dir")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ConfigError(f"--time-budget must be positive, not {self.time_budget_s:g}s")
        if any(w < 1 for w in self.mlp_widths):
            raise ConfigError(f"--mlp-widths must be positive integers, not {self.mlp_widths}")
        return self

    def lr_factor(self) -> float:
        """``--lr-scaling``: the multiplier of ``--lr`` for this global batch (1 with ``none``)."""
        if self.lr_scaling == "none":
            return 1.0
        ratio = self.global_batch_size / self.base_batch_size
        return ratio if self.lr_scaling == "linear" else ratio ** 0.5

    @property
    def effective_lr(self) -> float:
        return self.lr * self.lr_factor()

    def strategy(self) -> dict:
        """The strategy flags as they appear in ``summary.json``."""
        return {"dp_sync": self.dp_sync, "collective": self.collective, "bucket_mb": self.bucket_mb,
                "zero": self.zero, "tp": self.tp, "tp_style": self.tp_style if self.tp > 1 else None,
                "sync_bn": self.sync_bn, "grad_accum": self.grad_accum}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mlp_widths"] = list(self.mlp_widths)
        return d
