"""The optimizer and its learning-rate schedule, from a :class:`~distlab.train.TrainConfig`."""

from __future__ import annotations

import math

import torch
from torch import nn

from distlab.train.config import TrainConfig


NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, *([nn.RMSNorm] if hasattr(nn, "RMSNorm") else []))


def no_decay_names(model: nn.Module) -> set[str]:
    """The parameters AdamW's weight decay leaves alone (GPT-2's and minGPT's convention): biases, the
    norms' scales and shifts, and embeddings -- every parameter but the weights of matrix
    multiplications (linear and convolution weights, a mixture of experts' stacked weights). Names are
    ``model``'s: the whole model's, before a layout cuts it."""
    skip = set()
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, (nn.Embedding, *NORMS)) or name.endswith("bias") or p.dim() < 2:
                skip.add(f"{prefix}.{name}" if prefix else name)
    return skip


def decay_groups(cfg: TrainConfig) -> bool:
    """Whether this run's optimizer splits its parameters into a decayed and an undecayed group: AdamW
    with a weight decay (SGD's and Adam's weight decay, an L2 term, applies to every parameter)."""
    return cfg.optimizer == "adamw" and cfg.weight_decay > 0


def build_optimizer(params, cfg: TrainConfig, names: list[str] | None = None,
                    no_decay: set[str] = frozenset()) -> torch.optim.Optimizer:
    """``optimizer`` at the effective LR (``lr`` scaled by ``lr_scaling`` for the global batch). AdamW with a
    weight decay gets two groups (:func:`decay_groups`): ``params`` whose whole-model name (``names``, in
    their order) is in ``no_decay`` go to the second, with no decay -- the same parameters on every layout,
    however ZeRO, tensor or pipeline parallel cut them."""
    lr = cfg.effective_lr
    params = list(params)
    kernel = kernels(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kernel)
    if cfg.optimizer_state != "fp32":  # the moments in bfloat16 (:mod:`distlab.train.low_precision_optim`)
        from distlab.train.low_precision_optim import STATE_DTYPES, Adam16
        kind = dict(decoupled=cfg.optimizer == "adamw", state_dtype=STATE_DTYPES[cfg.optimizer_state])
        if decay_groups(cfg) and names is not None:
            return Adam16([{"params": [p for p, n in zip(params, names) if n not in no_decay]},
                           {"params": [p for p, n in zip(params, names) if n in no_decay], "weight_decay": 0.0}],
                          lr=lr, weight_decay=cfg.weight_decay, **kind)
        return Adam16(params, lr=lr, weight_decay=cfg.weight_decay, **kind)
    if cfg.optimizer == "adamw":
        if decay_groups(cfg) and names is not None:
            groups = [{"params": [p for p, n in zip(params, names) if n not in no_decay]},
                      {"params": [p for p, n in zip(params, names) if n in no_decay], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=lr, weight_decay=cfg.weight_decay, **kernel)
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, **kernel)
    return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay, **kernel)


def kernels(params: list) -> dict:
    """The optimizer's kernel: on a GPU one fused kernel per step updates every tensor (torch's default
    there is foreach: a kernel per operation over all tensors), and it can skip a step on the device
    (:mod:`distlab.parallel.verdict`); on the CPU torch's default."""
    return {"fused": True} if params and all(p.is_cuda for p in params) else {}


def optimizer_index(optimizer: torch.optim.Optimizer, params: list) -> list[int]:
    """Where each of ``params`` sits in ``optimizer.state_dict()``'s numbering (its groups' order)."""
    position = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return [position[id(p)] for p in params]


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


class _Constant(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose multiplier is 1 at every step: a step only counts (the same state as
    LambdaLR's, so snapshots read alike), without recomputing a learning rate that never changes."""

    def step(self, epoch=None) -> None:
        if not hasattr(self, "_last_lr"):  # the constructor's first step sets the rates: LambdaLR's own
            return super().step(epoch)
        self._step_count += 1
        self.last_epoch += 1


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    kind = _Constant if cfg.lr_schedule == "constant" and not cfg.warmup_steps else torch.optim.lr_scheduler.LambdaLR
    return kind(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
