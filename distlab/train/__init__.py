"""Training: configuration, the Trainer loop, evaluation and run outputs."""

from distlab.train.config import TrainConfig
from distlab.train.trainer import Trainer, evaluate

__all__ = ["TrainConfig", "Trainer", "evaluate"]
