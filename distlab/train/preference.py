"""Direct preference optimisation (DPO; Rafailov et al., 2023) on every layout.

For a pair -- a prompt, a chosen completion ``c`` and a rejected one ``r`` -- with ``log pi(c)`` the sum
of the trained model's log-probabilities of ``c``'s tokens and ``log ref(c)`` the reference model's::

    loss = -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))

averaged over the pairs of the global batch. ``beta (log pi - log ref)`` is a completion's *reward*;
the reward margin (chosen minus rejected) and the preference accuracy (the share of pairs whose chosen
completion has the larger reward) are logged beside the loss, as TRL's ``rewards/margins`` and
``rewards/accuracies``.

**The reference** is the model training starts from -- with ``--lora``, the base without its adapters
(:func:`distlab.models.lora.adapters_off`; TRL's PEFT reference). Its log-probabilities are computed
once, before the first step, by the run's own engine on its own layout in evaluation mode (no dropout),
and kept per token beside the data (:attr:`~distlab.data.preference.PreferenceDataset.reference`) -- TRL's
``precompute_ref_log_probs``: no second model in memory, one reference forward per pair instead of one per
pair per epoch. A resumed run recomputes them before it loads its snapshot, from the same starting model.

**On every layout** the loss is that of one process: a pair's two windows are consecutive rows, so a
data-parallel shard, an accumulation micro-batch or a pipeline micro-batch holds whole pairs; under
tensor parallel the vocabulary-parallel head scores the tokens across its shards; under context parallel
each rank sums its own tokens' log-probabilities and one all-reduce (identity backward: each rank's
gradient is its own tokens') gives every rank the sequence's. Each micro-batch's loss is its pairs' sum
times ``micro_steps x replicas / pairs of the global batch``, as
:func:`~distlab.parallel.loss_head.per_kept_target` scales a mean over kept tokens.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.data.loader import EvalLoader
from distlab.models import IGNORE_INDEX, lora
from distlab.parallel.tensor_parallel.mappings import reduce_from_group
from distlab.runtime import group_size, reduce_scalars, timeline
from distlab.train.evaluate import outputs

DEFAULT_BETA = 0.1  # TRL's and torchtune's default


def pair_scores(logps: torch.Tensor, reference: torch.Tensor, beta: float):
    """``(losses, chosen rewards, rejected rewards)`` per pair from per-row sums of the trained model's and
    the reference's log-probabilities (rows: chosen, rejected, chosen, ...) -- the module's formula."""
    rewards = beta * (logps - reference)
    chosen, rejected = rewards[0::2], rewards[1::2]
    return -F.logsigmoid(chosen - rejected), chosen, rejected


def token_logps(score, out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probabilities, reference log-probabilities)`` of each row's targets summed over its tokens
    (this rank's: context parallel holds a part of each row), from the output and ``y`` (``(rows, T, 2)``:
    targets, reference log-probabilities); ``score`` the engine's loss (``reduction="none"``: per token)."""
    target = y[..., 0].long()
    kept = target != IGNORE_INDEX
    logp = -score(out, target, reduction="none").reshape(target.shape)
    return logp.masked_fill(~kept, 0.0).sum(1), y[..., 1].masked_fill(~kept, 0.0).sum(1)


class Preference:
    """The DPO loss of a run's steps (call it as the loss function), its reference pass
    (:meth:`compute_reference`), the window's reward statistics (:meth:`window`) and evaluation
    (:meth:`evaluate`)."""

    ignore_index = None  # the loss is a pair's, scaled by itself (not a mean over kept targets)

    def __init__(self, engine, beta: float, global_pairs: int, micro_steps: int, device,
                 narrow: Callable[[], ContextManager] = contextlib.nullcontext):
        self.engine, self.beta, mesh = engine, beta, engine.mesh
        self.narrow = narrow  # (a frozen base held in bf16 computes under autocast, as the steps do)
        self.scale = micro_steps * mesh.replicas / global_pairs
        self.cp_group = mesh.cp_group if mesh.cp > 1 else None
        self.counts = mesh.reports and mesh.cp_rank == 0  # one rank per pair counts its statistics
        self.device = device
        self.stats = torch.zeros(4, dtype=torch.float64, device=device)  # pairs, preferred, margin, chosen reward

    @classmethod
    def of(cls, trainer, narrow: Callable[[], ContextManager] = contextlib.nullcontext) -> "Preference | None":
        """A trainer's DPO, its data's reference log-probabilities computed (collective); None where its data
        are not preference pairs."""
        from distlab.data.preference import PreferenceDataset
        cfg = trainer.cfg
        if not isinstance(trainer.train_set, PreferenceDataset):
            return None
        made = cls(trainer.engine, cfg.dpo_beta or DEFAULT_BETA, cfg.global_batch_size, cfg.strategy.micro_steps,
                   trainer.rt.device, narrow)
        for data in (trainer.train_set, trainer.eval_test, trainer.eval_val):  # (what the steps and evaluations read)
            if data is not None:
                made.compute_reference(data, trainer.eval_batch)
        return made

    def targets(self, y: torch.Tensor) -> torch.Tensor:  # a pair's targets beside their reference positions
        return y[..., 0].long()

    def batch(self, x: torch.Tensor, y: torch.Tensor, fields, step: int) -> tuple:
        return x, y, fields

    def _scores(self, out, y):
        logps, reference = token_logps(self.engine.loss, out, y)
        if self.cp_group is not None:  # each rank's tokens' sums -> the sequences'
            logps = reduce_from_group(logps, self.cp_group)
            reference = reduce_from_group(reference, self.cp_group)
        return pair_scores(logps, reference.to(logps.dtype), self.beta)

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses, chosen, rejected = self._scores(out, y)
        if self.counts:
            self._count(self.stats, chosen.detach(), rejected.detach())
        loss = losses.sum() * self.scale
        if self.cp_group is not None:  # every CP rank holds the pairs' loss: each reports a share of it
            loss = loss + (loss / self.engine.mesh.cp - loss).detach()
        return loss

    @staticmethod
    def _count(stats, chosen, rejected) -> None:
        margin = (chosen - rejected).double()
        stats += torch.stack([torch.tensor(float(len(margin)), dtype=torch.float64, device=margin.device),
                              (margin > 0).double().sum(), margin.sum(), chosen.double().sum()])

    def window(self) -> dict:
        """The reward statistics of the steps since the last call, over the global batch (collective)."""
        pairs, preferred, margin, chosen = reduce_scalars(self.stats.tolist(), device=self.device)
        self.stats.zero_()
        if not pairs:
            return {}
        return {"reward_accuracy": preferred / pairs, "reward_margin": margin / pairs, "reward_chosen": chosen / pairs,
                "reward_rejected": (chosen - margin) / pairs}

    @torch.no_grad()
    def compute_reference(self, dataset, batch_size: int) -> None:
        """Fill ``dataset.reference`` with the starting model's log-probability of every target (module
        docstring): each rank scores its shard, one all-reduce joins them (collective)."""
        engine, mesh = self.engine, self.engine.mesh
        found = torch.zeros(len(dataset.tokens), dtype=torch.float32, device=self.device)
        loader = EvalLoader(dataset.with_positions(), rank=mesh.dp_rank, world_size=mesh.dp, batch_size=batch_size)
        was_training = engine.module.training
        engine.module.eval()
        with timeline.span("reference log-probabilities"), engine.gathered(), self.narrow(), \
                lora.adapters_off(engine.module):
            for _, out, y in outputs(engine, loader, self.device):
                target = y[..., 0].long()
                kept = target != IGNORE_INDEX
                logp = -engine.loss(out, target, reduction="none").reshape(target.shape).float()  # (TP: collective)
                if mesh.reports:
                    found[y[..., 1].long()[kept]] = logp[kept]
        engine.module.train(was_training)
        if group_size() > 1:
            dist.all_reduce(found)  # (disjoint places, each written by one rank: exact)
        dataset.reference = found.to(dataset.tokens.device)

    @torch.no_grad()
    def evaluate(self, dataset, batch_size: int, stop=None, details: bool = False) -> dict:
        """DPO's loss, preference accuracy and reward margin over ``dataset``'s pairs (collective; ``stop``:
        :func:`~distlab.train.evaluate.outputs`'; no per-sample details)."""
        engine, mesh = self.engine, self.engine.mesh
        was_training = engine.module.training
        engine.module.eval()
        stats = torch.zeros(4, dtype=torch.float64, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        loader = EvalLoader(dataset, rank=mesh.dp_rank, world_size=mesh.dp, batch_size=batch_size)
        with self.narrow():
            for _, out, y in outputs(engine, loader, self.device, stop):
                losses, chosen, rejected = self._scores(out, y)
                if self.counts:
                    self._count(stats, chosen, rejected)
                    loss_sum += losses.double().sum()
        engine.module.train(was_training)
        pairs, preferred, margin, _, loss = reduce_scalars([*stats.tolist(), float(loss_sum)], device=self.device)
        return {"test_loss": loss / max(pairs, 1), "test_accuracy": preferred / max(pairs, 1),
                "test_reward_margin": margin / max(pairs, 1), "test_samples": len(dataset)}
