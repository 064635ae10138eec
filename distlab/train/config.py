"""Training configuration: one dataclass, validated once, with the numbers in the messages."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from distlab.data import canonical_name
from distlab.errors import ConfigError
from distlab.models import check_model_name
from distlab.parallel import SYNC_METHODS

OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("constant", "cosine", "linear")


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
    bucket_mb: float = 25.0
    out: str | None = None
    progress: bool | None = None  # None: on when stderr is a terminal
    timing_warmup_steps: int = 5
    extra: dict = field(default_factory=dict)

    def validate(self, world_size: int) -> "TrainConfig":
        """Check every flag against the others and the world size; raise ConfigError naming numbers."""
        check_model_name(self.model)
        self.dataset = canonical_name(self.dataset)
        if self.dp_sync not in SYNC_METHODS:
            raise ConfigError(f"unknown --dp-sync {self.dp_sync!r}; choose one of: {', '.join(SYNC_METHODS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown --optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown --lr-schedule {self.lr_schedule!r}; choose one of: {', '.join(LR_SCHEDULES)}")
        if self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be positive, not {self.global_batch_size}")
        if self.global_batch_size % world_size:
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by world size {world_size}: "
                f"use a multiple of {world_size} (e.g. {world_size * max(1, self.global_batch_size // world_size)})"
            )
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1, not {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps must be at least 1, not {self.max_steps}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, not {self.lr}")
        if self.log_every < 1:
            raise ConfigError(f"--log-every must be at least 1, not {self.log_every}")
        if any(w < 1 for w in self.mlp_widths):
            raise ConfigError(f"--mlp-widths must be positive integers, not {self.mlp_widths}")
        return self

    def strategy(self) -> dict:
        """The strategy flags as they appear in ``summary.json``."""
        return {"dp_sync": self.dp_sync, "collective": "native", "bucket_mb": self.bucket_mb,
                "zero": 0, "tp": 1, "tp_style": None, "sync_bn": "off", "grad_accum": 1}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mlp_widths"] = list(self.mlp_widths)
        return d
