"""What a run minimises and what its evaluations score -- one object, chosen once from the data: the task's
cross-entropy (its targets smoothed if asked, ignored ones left out) or, on preference pairs, DPO's loss
(:class:`~distlab.train.preference.Preference`). The loop and the evaluations call the :class:`Objective` and
never ask which one it is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager, Protocol

import torch

from distlab.models import IGNORE_INDEX
from distlab.train.evaluate import evaluate


class Objective(Protocol):
    """The loss of a run's steps (call it as the loss function) and what an evaluation reports."""

    ignore_index: int | None  # targets left out of the global mean (the Engine counts the kept ones)

    def __call__(self, out: torch.Tensor, y: torch.Tensor, **how) -> torch.Tensor:
        """The loss of a micro-batch (``how``: :meth:`Engine.loss <distlab.parallel.Engine.loss>`'s
        ``reduction``, where the Engine sums kept targets itself)."""

    def targets(self, y: torch.Tensor) -> torch.Tensor:
        """A batch's targets as the model's output is scored against (what priming a resumed run's buckets
        runs a backward with)."""

    def batch(self, x: torch.Tensor, y: torch.Tensor, fields, step: int) -> tuple:
        """``(x, y, fields)`` step ``step`` trains on, from the loader's batch: the batch itself, or (GRPO) the
        rollout of its prompts (collective)."""

    def window(self) -> dict:
        """The objective's own statistics since the last log line, over the global batch (collective; {} where
        it keeps none)."""

    def evaluate(self, dataset, batch_size: int, stop=None, details: bool = False) -> dict:
        """``test_*`` figures of ``dataset`` (collective; ``details``: a classifier's confusion and mistakes)."""


class CrossEntropy:
    """The task's loss (:meth:`Engine.loss <distlab.parallel.Engine.loss>`): cross-entropy, ``label_smoothing``
    on the training targets only; evaluations report the plain loss and accuracy
    (:func:`~distlab.train.evaluate.evaluate`) under ``narrow`` (a frozen base held in bf16 computes under
    autocast there too)."""

    def __init__(self, engine, label_smoothing: float, ignores_targets: bool, device,
                 narrow: Callable[[], ContextManager] = contextlib.nullcontext):
        self.engine, self.device, self.narrow = engine, device, narrow
        self.loss = functools.partial(engine.loss, label_smoothing=label_smoothing) if label_smoothing else engine.loss
        self.ignore_index = IGNORE_INDEX if ignores_targets else None

    def __call__(self, out: torch.Tensor, y: torch.Tensor, **how) -> torch.Tensor:
        return self.loss(out, y, **how)

    def targets(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def batch(self, x: torch.Tensor, y: torch.Tensor, fields, step: int) -> tuple:
        return x, y, fields

    def window(self) -> dict:
        return {}

    def evaluate(self, dataset, batch_size: int, stop=None, details: bool = False) -> dict:
        with self.narrow():
            return evaluate(self.engine, dataset, device=self.device, batch_size=batch_size, details=details,
                            stop=stop)


def objective_of(trainer) -> Objective:
    """The objective of ``trainer``'s data (DPO's reference log-probabilities computed now, GRPO's starting weights
    kept: collective)."""
    from distlab.train.grpo import Grpo
    from distlab.train.preference import Preference
    cfg, narrow = trainer.cfg, trainer.narrow
    return Preference.of(trainer, narrow) or Grpo.of(trainer, narrow) or CrossEntropy(trainer.engine, cfg.label_smoothing,
                                                          trainer.train_set.ignores_targets, trainer.rt.device, narrow)
