"""What :mod:`distlab.tools.verify`'s single-process reference reads besides a model and a batch: DPO's
reference log-probabilities and its loss, the generated fine-tuning records ``+pack`` packs, GRPO's rollouts and
loss on one process, and how a run is compared with it."""

from __future__ import annotations

import dataclasses

import torch


def compare(params, losses, ref_params, ref_losses) -> dict:
    """The largest differences of a run's parameters (absolute, relative) and losses from the reference's."""
    abs_diff = max((a - b).abs().max().item() for a, b in zip(params, ref_params))
    rel_diff = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(params, ref_params))
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0)
    return {"max_abs_param_diff": abs_diff, "max_rel_param_diff": rel_diff, "max_loss_diff": loss_diff}


def packing_records(n: int = 160) -> str:
    """``sft:FILE`` of ``n`` generated prompt/completion records of 4 to 13 bytes (written once, atomically, in
    the temporary directory): +pack's data, several records to a window of 16 tokens."""
    import json
    import random
    import tempfile
    from pathlib import Path
    from distlab.train.metrics import atomic_write_text
    rng = random.Random(0)
    lines = [json.dumps({"prompt": f"{i % 10}:", "completion": "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 10)))})
             for i in range(n)]
    path = Path(tempfile.gettempdir()) / f"distlab-verify-records-{n}.jsonl"
    text = "\n".join(lines) + "\n"
    if not path.is_file() or path.read_text() != text:
        atomic_write_text(path, text)
    return f"sft:{path}"


@torch.no_grad()
def reference_logps(model: torch.nn.Module, data) -> torch.Tensor:
    """Each target's log-probability under ``model`` in evaluation mode, per place of ``data``'s stream (one
    process, every pair in one batch): DPO's reference."""
    from distlab.models import IGNORE_INDEX, task_loss
    was = model.training
    model.eval()
    x, y = data.with_positions().batch(torch.arange(len(data)))
    target = y[..., 0].long()
    kept = target != IGNORE_INDEX
    found = torch.zeros(len(data.tokens))
    found[y[..., 1].long()[kept]] = -task_loss(model(x), target, reduction="none").reshape(target.shape)[kept]
    model.train(was)
    return found


def dpo_mean(beta: float):
    """DPO's loss of a batch of pairs, the mean over them (``label_smoothing`` ignored: refused with pairs)."""
    from distlab.models import task_loss
    from distlab.train.preference import pair_scores, token_logps

    def loss(out, y, label_smoothing=0.0):
        logps, reference = token_logps(task_loss, out, y)
        return pair_scores(logps, reference.to(logps.dtype), beta)[0].mean()
    return loss


# +grpo: GRPO from a reward on generated sums (a reward every few random completions earn: the groups' advantages
# differ), the KL to the starting model scored
GRPO = {"reward": "regex:[0-9a-z]", "group_size": 4, "kl_beta": 0.1, "ppo_epochs": 2}  # (a step off-policy)
GRPO_DATA = "synthetic-rl:400"


def grpo_training(cfg, model, data):
    """One process's GRPO (None without it): ``rollout(y, step)`` gives a step's rows, targets and loss function --
    the run's own rollout (:func:`distlab.train.grpo.rollout_rows`) by ``model`` itself, the reference the starting
    weights (with LoRA: the base, adapters off)."""
    import copy

    from distlab.models import task_loss
    from distlab.train.grpo import rollout_rows, token_losses
    from distlab.train.rewards import Rewards
    if cfg.reward is None:
        return None
    rewards, start = Rewards(cfg.reward, cfg.reward_weights), copy.deepcopy(model) if cfg.lora is None else None
    eps_high = cfg.clip_epsilon_high if cfg.clip_epsilon_high is not None else cfg.clip_epsilon

    def loss(out, y, label_smoothing=0.0):
        target = y[..., 0].long()
        logp = -task_loss(out, target, reduction="none").reshape(target.shape)
        losses = token_losses(logp, y, cfg.clip_epsilon, eps_high, cfg.kl_beta, cfg.ppo_epochs == 1)[0]
        return (losses * y[..., 4].to(logp.dtype)).masked_fill(target < 0, 0.0).sum()

    kept: dict[int, tuple] = {}  # --ppo-epochs: a rollout trains that many steps

    def rollout(y, step):
        reference = (model if start is None else start) if cfg.kl_beta else None
        number = step // cfg.ppo_epochs
        if number not in kept:
            kept[number] = rollout_rows(model, data, y[:, 0].tolist(), cfg, number, rewards, reference,
                                        start is None)[:2]
        return (*kept[number], loss)
    return rollout


def grpo_tolerance(cfg, world_size: int) -> float:
    """The float32 bound of a GRPO run (:func:`~distlab.tools.verify.sgd_tolerance`): each completion's tokens
    weigh ``1 / (its tokens x completions)`` in all, times an advantage of at most ``(G - 1) / sqrt(G)`` (the
    largest z-score ``G`` numbers have), plus the KL term's ``beta`` -- a cross-entropy's gradient over the global
    batch's completions, scaled by that."""
    from distlab.tools.bounds import sgd_tolerance
    g = cfg.group_size
    s = cfg.strategy
    return sgd_tolerance(cfg.max_steps, cfg.lr * ((g - 1) / g ** 0.5 + cfg.kl_beta), cfg.global_batch_size * g,
                         cfg.momentum, s.precision, s.wire_dtype or "fp32", s.dp_size(world_size))


class _Scratch:
    """Directories a verify run writes and removes (``+offload``: each case's offload files)."""

    def __init__(self):
        self.made: list[str] = []

    def __call__(self, name: str) -> str:
        """A path no one uses, made only when a run writes there."""
        import tempfile
        import uuid
        self.made.append(f"{tempfile.gettempdir()}/distlab-verify-{uuid.uuid4().hex}")
        return f"{self.made[-1]}/{name}"

    def clear(self) -> None:
        import shutil
        while self.made:
            shutil.rmtree(self.made.pop(), ignore_errors=True)


scratch = _Scratch()


def table(records: list[dict]) -> str:
    width = max([28] + [len(r["strategy"]) for r in records])
    rows = [f"{'strategy':<{width}} {'world':>5} {'steps':>5} {'max |dparam|':>12} {'max rel':>9} {'max |dloss|':>11} "
            f"{'tolerance':>9}  result"]
    for r in records:
        rows.append(f"{r['strategy']:<{width}} {r['world_size']:>5} {r['steps']:>5} {r['max_abs_param_diff']:>12.2e} "
                    f"{r['max_rel_param_diff']:>9.1e} {r['max_loss_diff']:>11.2e} "
                    + (f"{'-':>9}  APPROX" if r["passed"] is None else
                       f"{r['tolerance']:>9.1e}  {'PASS' if r['passed'] else 'FAIL'}"))
    if any(r["passed"] is None for r in records):
        rows.append("APPROX: no rounding bound exists (compressed gradients approximate the mean; Adam divides by "
                    "each entry's own size); the columns give the measured deviation from single-process training.")
    return "\n".join(rows)


def reference_key(cfg) -> str:
    """What :func:`~distlab.tools.verify.reference_run` reads of ``cfg``: every setting but the layout's (the
    strategy, bar its precision) and where offloaded state goes -- configs with one key have one single-process
    run."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("strategy", "offload", "offload_dir")}
    return repr((sorted(settings.items()), cfg.strategy.precision))
