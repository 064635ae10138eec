"""What scores a model's output (:class:`~distlab.parallel.protocols.LossHead`): the task's own
cross-entropy and accuracy (:class:`TaskHead`), or -- where tensor parallel split the LM head -- its
vocabulary-parallel head, which scores across the shards so no rank builds the full logits."""

from __future__ import annotations

import torch
from torch import nn

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
