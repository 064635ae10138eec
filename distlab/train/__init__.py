"""Training: configuration, the Trainer (build + loop), run state (snapshots, time budget), evaluation, summary."""

from distlab.train.config import TrainConfig
from distlab.train.evaluate import evaluate
from distlab.train.trainer import Trainer

__all__ = ["TrainConfig", "Trainer", "evaluate"]
