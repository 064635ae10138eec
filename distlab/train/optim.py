"""The optimizer and its learning-rate schedule, from a :class:`~distlab.train.TrainConfig`."""

from __future__ import annotations

import math

import torch

from distlab.train.config import TrainConfig


from distlab.models.parameter_roles import NORMS, no_decay_names  # noqa: F401 (here since before)


def decay_groups(cfg: TrainConfig) -> bool:
    """Whether this run's optimizer splits its parameters into a decayed and an undecayed group: AdamW (and Muon's
    AdamW) with a weight decay (SGD's and Adam's weight decay, an L2 term, applies to every parameter)."""
    return cfg.optimizer in ("adamw", "muon") and cfg.weight_decay > 0


def build_optimizer(params, cfg: TrainConfig, names: list[str] | None = None,
                    no_decay: set[str] = frozenset(), matrices: set[str] = frozenset(),
                    levels: dict | None = None, offload=None, ahead=None) -> torch.optim.Optimizer:
    """``optimizer`` at the effective LR (``lr`` scaled by ``lr_scaling`` for the global batch). AdamW with a
    weight decay gets two groups (:func:`decay_groups`): ``params`` whose whole-model name (``names``, in
    their order) is in ``no_decay`` go to the second, with no decay -- the same parameters on every layout,
    however ZeRO, tensor or pipeline parallel cut them. ``offload`` (an
    :class:`~distlab.parallel.offload.OffloadStore`): Adam's moments held there (torch's step, line for line, in
    :class:`~distlab.train.low_precision_optim.Adam16`), each parameter stepped on the host; ``ahead`` (a
    :class:`~distlab.parallel.step_ahead.StepAhead`, ``--offload-overlap``): those steps on its thread."""
    lr = cfg.effective_lr
    params = list(params)
    kernel = kernels(params)
    if cfg.optimizer == "muon":  # ``matrices`` (whole-model names) by Muon, the rest by AdamW; ``levels``: how
        from distlab.train.low_precision_optim import STATE_DTYPES  # each matrix is cut on this layout
        from distlab.train.muon import Muon
        kinds = [(n in matrices, n in no_decay) for n in names]
        groups = [{"params": [p for p, k in zip(params, kinds) if k[0]], "muon": True},
                  {"params": [p for p, k in zip(params, kinds) if not k[0] and not k[1]]},
                  {"params": [p for p, k in zip(params, kinds) if not k[0] and k[1]], "weight_decay": 0.0}]
        return Muon([g for g in groups if g["params"]], lr=lr, levels=levels, weight_decay=cfg.weight_decay,
                    state_dtype=STATE_DTYPES[cfg.optimizer_state], offload=offload)
    if cfg.optimizer == "sgd" and offload is not None:  # its momentum buffer offloaded
        from distlab.train.low_precision_optim import OffloadedSGD
        return OffloadedSGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, offload=offload,
                            ahead=ahead)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kernel)
    if cfg.optimizer_state != "fp32" or offload is not None:  # the moments in bfloat16, or offloaded
        from distlab.train.low_precision_optim import STATE_DTYPES, Adam16
        kind = dict(decoupled=cfg.optimizer == "adamw", state_dtype=STATE_DTYPES[cfg.optimizer_state],
                    offload=offload, ahead=ahead)
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
