"""What scores a model's output (:class:`~distlab.parallel.protocols.LossHead`): the task's own
cross-entropy and accuracy (:class:`TaskHead`), or -- where tensor parallel split the LM head -- its
vocabulary-parallel head, which scores across the shards so no rank builds the full logits."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from distlab import comm

from distlab.models import task_correct, task_loss
from distlab.parallel.tensor_parallel.vocabulary import VocabParallelLinear


def vocab_parallel_head(model: nn.Module) -> VocabParallelLinear | None:
    """The model's vocabulary-parallel output layer, if tensor parallel gave it one."""
    return next((m for m in model.modules() if isinstance(m, VocabParallelLinear)), None)


class TaskHead:
    """The task's own scoring of whole logits: cross-entropy and accuracy per sample (a classifier) or
    per token (a language model) -- the :class:`~distlab.parallel.protocols.LossHead` of every model
    whose output layer tensor parallel did not split."""

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
        return task_loss(out, y, reduction, label_smoothing)

    @staticmethod
    def correct(out: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
        return task_correct(out, y)


def loss_head(model: nn.Module):
    """What scores ``model``'s output: its vocabulary-parallel head where tensor parallel split the LM
    head (no rank builds the full logits), else the task's own :class:`TaskHead`."""
    head = vocab_parallel_head(model)
    return TaskHead() if head is None else head


def per_kept_target(loss_fn: Callable, y: torch.Tensor, ignore_index: int, mesh, micro_steps: int) -> Callable:
    """``loss_fn`` as a share of the global batch's mean over kept targets: each micro-batch's sum
    over its kept targets times ``micro_steps x replicas / N``, where ``N`` counts the kept targets
    of the whole global batch (one all-reduce of a number over the replicas, left on the device).
    The schedule divides by ``micro_steps`` and the gradient sync averages over the ``replicas``,
    so the step's gradient is the sum over every kept target divided by ``N`` -- torch's ``mean``
    with ``ignore_index`` on one process (and 0, not nan, where the global batch keeps none)."""
    kept = (y != ignore_index).sum().to(torch.float32).reshape(1)
    if mesh.replicas > 1:
        comm.all_reduce(kept, algorithm="native", group=mesh.replica_group)
    scale = micro_steps * mesh.replicas / kept.clamp(min=1.0)

    def share_of_global_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(out, target, reduction="sum") * scale[0]
    return share_of_global_mean
