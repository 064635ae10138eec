"""Group relative policy optimisation (GRPO; Shao et al., 2024, DeepSeekMath) on every layout.

Each step takes ``B`` prompts (``--global-batch-size``), samples ``G`` completions of each from the policy
(``--group-size``; :mod:`distlab.train.rollout`), scores each with the rewards (``--reward``;
:mod:`distlab.train.rewards`) and gives every token of completion ``i`` of a group the same *advantage*::

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)        (the group's mean and unbiased std; --no-scale-rewards: no std)

Then, per completion token ``t`` with ``ratio = exp(log pi(t) - log pi_old(t))`` (``pi_old``: the policy that
sampled it) and, with ``--kl-beta``, the k3 estimate of the KL divergence to the reference,
``kl = exp(log ref - log pi) - (log ref - log pi) - 1``::

    loss_t = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) + beta kl

summed with a weight per token that is the loss normalisation people use (``--grpo-loss``): ``grpo``, a mean over
each completion's tokens, then over the completions (the paper's); ``dapo``, a mean over every completion token of
the global batch (DAPO's); ``dr_grpo``, the sum over ``N x max_new_tokens`` (Dr. GRPO's constant) -- each TRL's
formula of the same name. The prompt and the padding are never targets.

**Old and reference log-probabilities, once per rollout.** With ``--ppo-epochs K`` each rollout batch trains
``K`` optimizer steps (TRL's ``num_iterations``): ``log pi_old`` is the generation copy's, computed once at the
rollout (``K`` 1: the policy's own, detached, so the ratio is 1). The reference is the model training started
from -- with ``--lora``, the base with its adapters off (no second model); without, the starting weights kept in
host memory -- scored by the generation copy once per rollout.

**On every layout** the loss is that of one process: everything but the policy's own log-probability travels in
the targets ``y`` (``(rows, T, 5)``: target, advantage, old and reference log-probabilities, the token's weight),
which a micro-batch, a pipeline's last stage and a context-parallel rank cut exactly as they cut the targets; the
weights already hold the global batch's normalisation, so a micro-batch's loss is its tokens' weighted sum times
``micro_steps x replicas`` (the schedule divides by the one, the gradient sync averages over the other).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, ContextManager

import torch

from distlab.models import IGNORE_INDEX, build_model, lora
from distlab.models.plans import assign_state
from distlab.parallel import step_ahead
from distlab.runtime import group_size, reduce_scalars, timeline
from distlab.train import rollout
from distlab.train.rewards import Rewards
from distlab.runtime.meta import on_meta_device

LOSSES = ("grpo", "dapo", "dr_grpo")
STATS = ("completions", "reward", "length", "entropy", "entropy_tokens", "rollouts", "rollout_s")  # then each reward's


def advantages(rewards: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` ``(groups, G)`` (module docstring)."""
    centred = rewards - rewards.mean(1, keepdim=True)
    return centred / (rewards.std(1, keepdim=True) + 1e-4) if scale else centred


def token_weights(kept: torch.Tensor, how: str, rows: int, tokens: float, max_new: int) -> torch.Tensor:
    """Each completion token's weight in the loss under normalisation ``how`` (``kept``: which places are
    completion tokens, per row; ``rows`` and ``tokens``: the global batch's completions and completion tokens)."""
    if how == "grpo":
        return kept / (kept.sum(1, keepdim=True).clamp_min(1) * rows)
    return kept / (tokens if how == "dapo" else rows * max_new)


def token_losses(logp: torch.Tensor, y: torch.Tensor, eps_low: float, eps_high: float, beta: float,
                 on_policy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss per token, kl per token, clipped per token)`` from the policy's log-probabilities and the
    targets' columns (module docstring); ``on_policy``: the old policy is this one (the ratio 1)."""
    adv, old, ref = y[..., 1], y[..., 2], y[..., 3]
    old = logp.detach() if on_policy else old.to(logp.dtype)
    ratio = torch.exp(logp - old)
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    kl = torch.zeros_like(loss)
    if beta:
        d = ref.to(logp.dtype) - logp
        kl = torch.exp(d) - d - 1
        loss = loss + beta * kl
    return loss, kl, clipped


def max_new(cfg, prompt: list[int]) -> int:
    """The most tokens ``prompt``'s completions may take: ``max_new_tokens``, within the window."""
    room = cfg.block_size + 1 - len(prompt)
    return max(0, min(room, cfg.max_new_tokens or room))


@torch.no_grad()
def rollout_rows(model, data, numbers: list[int], cfg, rollout_number: int, rewards: Rewards, reference=None,
                 adapters: bool = True, global_counts=lambda rows, tokens: (rows, tokens)):
    """``(inputs, targets, statistics)`` of the rollout of prompts ``numbers`` (records of ``data``) by ``model``
    (module docstring): ``group_size`` completions each, their rewards, advantages, old and -- ``reference``:
    the model that scores it, ``adapters``: with its adapters off -- reference log-probabilities and token
    weights; ``global_counts(rows, tokens)`` the global batch's completions and completion tokens."""
    g = cfg.group_size
    xs, ys, scores, each = [], [], [], []
    entropy = entropy_tokens = 0.0
    for number in numbers:
        prompt = data.prompts[number][:cfg.block_size]
        done, h, n = rollout.complete(model, prompt, g, max_new(cfg, prompt), cfg.temperature, cfg.top_p,
                                      data.stops, rollout.seed_of(cfg.seed, rollout_number, number))
        entropy, entropy_tokens = entropy + h, entropy_tokens + n
        for completion in done:
            total, parts = rewards.score(data.tokenizer.decode([t for t in completion if t not in data.stops]),
                                         data.fields[number])
            scores.append(total)
            each.append(parts)
            row_x, row_y = rollout.window(prompt, completion, cfg.block_size)
            xs.append(row_x)
            ys.append(row_y)
    rows_x, target = torch.stack(xs), torch.stack(ys)
    kept = (target != IGNORE_INDEX).double()
    adv = advantages(torch.tensor(scores, dtype=torch.float64).view(-1, g), cfg.scale_rewards).view(-1, 1)
    old = rollout.token_logps(model, rows_x, target) if cfg.ppo_epochs > 1 else torch.zeros(kept.shape)
    ref = torch.zeros(kept.shape, dtype=torch.float64)
    if reference is not None:
        ref = rollout.token_logps(reference, rows_x, target,
                                  (lambda: lora.adapters_off(reference)) if adapters else contextlib.nullcontext)
    rows, tokens = global_counts(float(len(xs)), float(kept.sum()))
    weight = token_weights(kept, cfg.grpo_loss, round(rows), tokens, cfg.max_new_tokens or cfg.block_size)
    stats = torch.tensor([len(xs), sum(scores), float(kept.sum()), entropy, entropy_tokens,
                          *torch.tensor(each).sum(0).tolist()], dtype=torch.float64)
    return rows_x, torch.stack([target.double(), adv.expand_as(kept), old, ref, weight], -1), stats


class Grpo:
    """GRPO as a run's objective (:class:`~distlab.train.objective.Objective`): :meth:`batch` turns a step's
    prompts into its rollout (collective), the call is the loss, :meth:`window` the rollouts' statistics and
    :meth:`evaluate` the test prompts' rewards."""

    ignore_index = None  # the loss carries its own normalisation (the token weights)

    def __init__(self, trainer, narrow: Callable[[], ContextManager] = contextlib.nullcontext):
        cfg, engine = trainer.cfg, trainer.engine
        self.cfg, self.engine, self.trainer, self.narrow = cfg, engine, trainer, narrow
        self.rewards = Rewards(cfg.reward or "exact", cfg.reward_weights)
        self.eps_low = cfg.clip_epsilon
        self.eps_high = cfg.clip_epsilon_high if cfg.clip_epsilon_high is not None else cfg.clip_epsilon
        self.scale = cfg.strategy.micro_steps * engine.mesh.replicas
        self.on_policy = cfg.ppo_epochs == 1
        self.counts = engine.mesh.reports and engine.mesh.cp_rank == 0  # one rank per rollout counts it
        self.device = trainer.rt.device
        self.stats = torch.zeros(len(STATS) + len(self.rewards.names), dtype=torch.float64)
        self.loss_stats = torch.zeros(3, dtype=torch.float64, device=self.device)  # tokens, kl, clipped
        self._cached: tuple[int, tuple] | None = None
        # the reference: the starting weights (without adapters: kept now, before a snapshot is loaded)
        self.start = None
        if cfg.kl_beta and cfg.lora is None:
            self.start = {k: v.detach().float().cpu().clone() for k, v in engine.full_state_dict().items()}

    @classmethod
    def of(cls, trainer, narrow=contextlib.nullcontext) -> "Grpo | None":
        from distlab.data.rl import PromptDataset
        return cls(trainer, narrow) if isinstance(trainer.train_set, PromptDataset) else None

    def targets(self, y: torch.Tensor) -> torch.Tensor:
        return y[..., 0].long()

    # ------------------------------------------------------------------ the rollout

    def copy(self, state: dict | None = None):
        """The generation copy: the whole policy (``state``: else gathered now, collective) in a model of its own, in
        float32 on the run's device."""
        cfg, data = self.cfg, self.trainer.train_set
        if state is None:  # (--offload-overlap: the last step's updates all finished first)
            step_ahead.settled()
            state = self.engine.full_state_dict()  # (copies, on the run's device)
        with on_meta_device():  # built without initialising: the run's random streams are untouched
            model = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options())
            if cfg.lora is not None and state is not self.start:
                lora.apply(model, cfg.lora)
        assign_state(model, {k: v.to(self.device, torch.float32) for k, v in state.items()})
        return model.eval()


    @torch.no_grad()
    def batch(self, x: torch.Tensor, y: torch.Tensor, fields=None, step: int = 1):
        """This rank's rollout of a step's prompts ``y`` (their records; :mod:`distlab.data.rl`): the rows to train
        on and their targets (module docstring). Collective (the policy gathered; one all-reduce of counts)."""
        number = (step - 1) // self.cfg.ppo_epochs
        if self._cached is not None and self._cached[0] == number:
            return self._cached[1]
        mesh = self.engine.mesh
        copies = group_size() // mesh.dp  # the ranks of a replica hold the same rollout: each counted once

        def global_counts(rows: float, tokens: float) -> tuple[float, float]:
            return tuple(v / copies for v in reduce_scalars([rows, tokens]))
        started = time.perf_counter()
        with timeline.span("rollout"):
            model = self.copy()
            reference = None if not self.cfg.kl_beta else model if self.start is None else self.copy(self.start)
            rows_x, y_out, stats = rollout_rows(model, self.trainer.train_set, y[:, 0].tolist(), self.cfg, number,
                                                self.rewards, reference, self.start is None, global_counts)
        self.stats += torch.cat([stats[:5], torch.tensor([1.0, time.perf_counter() - started], dtype=torch.float64),
                                 stats[5:]])
        made = (rows_x.to(x.device), y_out.to(x.device), None)
        self._cached = (number, made)
        return made

    # ------------------------------------------------------------------ the loss

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        target = y[..., 0].long()
        logp = -self.engine.loss(out, target, reduction="none").reshape(target.shape)
        losses, kl, clipped = token_losses(logp, y, self.eps_low, self.eps_high, self.cfg.kl_beta, self.on_policy)
        kept = target != IGNORE_INDEX
        weight = y[..., 4].to(logp.dtype)
        if self.engine.mesh.reports:  # (each context-parallel rank its own tokens)
            with torch.no_grad():
                self.loss_stats += torch.stack([kept.sum().double(), kl.masked_fill(~kept, 0).sum().double(),
                                                (clipped & kept).sum().double()])
        return (losses * weight).masked_fill(~kept, 0.0).sum() * self.scale

    def window(self) -> dict:
        """The rollouts' statistics since the last call, over the global batch (collective)."""
        own = self.stats.tolist() if self.counts else [0.0] * len(self.stats)  # (each replica's rollout once)
        sums = reduce_scalars([*own, *self.loss_stats.tolist()], device=self.device)
        self.stats.zero_()
        self.loss_stats.zero_()
        n, reward, length, entropy, entropy_tokens, rollouts, seconds = sums[:len(STATS)]
        each, (tokens, kl, clipped) = sums[len(STATS):len(STATS) + len(self.rewards.names)], sums[-3:]
        record = {"kl": kl / tokens, "clip_fraction": clipped / tokens} if tokens else {}
        if not n:  # (--ppo-epochs: a step training an earlier rollout again draws none)
            return record
        record.update({"reward": reward / n, "completion_length": length / n,
                       "entropy": entropy / entropy_tokens if entropy_tokens else None,
                       # a rollout's seconds (the replicas' mean; they generate at once) and the completion tokens
                       # all of them generate a second
                       "rollout_s": seconds / rollouts, "generated_tokens_per_s": length * self.engine.mesh.dp / seconds})
        if len(self.rewards.names) > 1:
            record.update({f"reward_{name}": v / n for name, v in zip(self.rewards.names, each)})
        return record

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, dataset, batch_size: int, stop=None, details: bool = False) -> dict:
        """The test prompts' greedy completions, each rank its data-parallel share: their mean reward (its negative
        as ``test_loss``, lower the better) and the share rewarded at all (collective)."""
        mesh = self.engine.mesh
        model = self.copy()
        total = rewarded = 0.0
        for k in range(-(-len(dataset) // mesh.dp)):  # as many on every rank: `stop` is collective
            if stop is not None and stop():
                break
            i = mesh.dp_rank + k * mesh.dp
            if not self.counts or i >= len(dataset):
                continue
            number = int(dataset.index[i])
            prompt = dataset.prompts[number][:self.cfg.block_size]
            done, _, _ = rollout.complete(model, prompt, 1, max_new(self.cfg, prompt), 0.0, 1.0, dataset.stops, 0)
            text = dataset.tokenizer.decode([t for t in done[0] if t not in dataset.stops])
            reward = self.rewards.score(text, dataset.fields[number])[0]
            total, rewarded = total + reward, rewarded + (reward > 0)
        total, rewarded = reduce_scalars([total, rewarded], device=self.device)
        n = max(len(dataset), 1)
        return {"test_loss": -total / n, "test_reward": total / n, "test_accuracy": rewarded / n,
                "test_samples": len(dataset)}


class Repeated:
    """A loader whose every batch comes ``times`` times in a row (``--ppo-epochs``: each rollout batch trains that
    many steps; TRL's repeated sampler): ``len`` and positions count the steps."""

    def __init__(self, loader, times: int):
        self.loader, self.times = loader, times

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader) * self.times

    def iter_from(self, position: int):
        first, skip = divmod(position, self.times)
        for i, batch in enumerate(self.loader.iter_from(first)):
            for _ in range(self.times - (skip if i == 0 else 0)):
                yield batch


def check(cfg) -> None:
    """What GRPO's flags need (ConfigError naming them): prompts to learn from, numbers in their ranges."""
    from distlab.data.rl import is_rl
    from distlab.errors import ConfigError
    rl = is_rl(cfg.dataset)
    given = [name for name, default in (("reward", None), ("reward_weights", None), ("group_size", 4),
                                        ("ppo_epochs", 1), ("kl_beta", 0.0), ("grpo_loss", "grpo"),
                                        ("max_new_tokens", None)) if getattr(cfg, name) != default]
    if given and not rl:
        raise ConfigError(f"`{given[0]}` is GRPO's, which learns from rewards on prompts (rl:FILE.jsonl or "
                          f"synthetic-rl); {cfg.dataset} is not prompts (drop `{given[0]}`)")
    if not rl:
        return
    Rewards(cfg.reward or "exact", cfg.reward_weights)  # each named reward found, the weights one each
    if cfg.group_size < 2:
        raise ConfigError(f"`group_size` {cfg.group_size}: GRPO compares a prompt's completions with each other; "
                          f"sample at least 2 (8 is usual)")
    if cfg.grpo_loss not in LOSSES:
        raise ConfigError(f"`grpo_loss` {cfg.grpo_loss!r}: choose {', '.join(LOSSES)}")
    for name in ("ppo_epochs", "max_new_tokens"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ConfigError(f"`{name}` must be at least 1, not {getattr(cfg, name)}")
    if not (cfg.temperature >= 0 and 0 < cfg.top_p <= 1 and cfg.kl_beta >= 0 and 0 < cfg.clip_epsilon < 1
            and (cfg.clip_epsilon_high is None or cfg.clip_epsilon_high > 0)):
        raise ConfigError("GRPO: `temperature` at least 0, `top_p` in (0, 1], `kl_beta` at least 0, `clip_epsilon` "
                          "in (0, 1) and `clip_epsilon_high` positive")
    if cfg.snapshot_every and cfg.snapshot_every % cfg.ppo_epochs:
        raise ConfigError(f"`snapshot_every` {cfg.snapshot_every}: each rollout trains `ppo_epochs` {cfg.ppo_epochs} "
                          f"steps, and a snapshot falls between rollouts: give a multiple of {cfg.ppo_epochs}")
    if cfg.pack or cfg.label_smoothing or cfg.dpo_beta is not None:
        raise ConfigError("GRPO trains on its own rollouts: drop `pack`, `label_smoothing` and `dpo_beta`")
    if math.isclose(cfg.temperature, 0.0) and cfg.group_size > 1:
        raise ConfigError("`temperature` 0 draws the same completion G times: every advantage is 0 and nothing is "
                          "learned; sample (1.0 is usual)")
