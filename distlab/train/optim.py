"""The optimizer and its learning-rate schedule, from a :class:`~distlab.train.TrainConfig`."""

from __future__ import annotations

import math

import torch

from distlab.train.config import TrainConfig


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``optimizer`` at the effective LR (``lr`` scaled by ``lr_scaling`` for the global batch)."""
    lr = cfg.effective_lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay)


def lr_multiplier(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """LR at ``step`` relative to the effective LR: linear warm-up over ``warmup_steps`` (from
    1/W to 1), times constant, cosine or linear decay to 0 over the run."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    progress = min(step / max(total_steps, 1), 1.0)
    if cfg.lr_schedule == "cosine":
        return warm * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.lr_schedule == "linear":
        return warm * (1.0 - progress)
    return warm


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
