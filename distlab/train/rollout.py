"""Rollouts: ``group_size`` completions of each prompt sampled from the policy, and the rows GRPO trains on.

**The policy as it is placed, gathered once.** Before a rollout every rank gathers the whole policy from its layout
-- data parallel's replica, ZeRO-3's shards, tensor parallel's slices, a pipeline's stages: one collective,
:meth:`Engine.full_state_dict <distlab.parallel.Engine.full_state_dict>`, not one per token -- into a generation
copy in float32 on the rank's own device (TRL's and verl's weight sync to their inference engine, here on the same
rank), and samples its own data-parallel shard's prompts with the copy's key/value cache. The ranks of one replica
(tensor, pipeline and context parallel) draw the same completions from the same prompts and seeds, so every layout
trains on the rollout one process draws.

**Seeded per prompt.** A prompt's ``G`` completions are drawn together (one prefill of the prompt, its cache
shared by the ``G`` rows, then ``G`` rows a step) from a
host generator (the same draws whatever the device computing the logits) seeded by the run's seed, the rollout's
number and the prompt's record -- a rerun, and a resumed run, draws the same completions, whatever the layout.
Sampling is the temperature's softmax over the vocabulary, cut to the smallest set reaching ``top_p``; a completion
ends at a stop token (kept: the model learns to stop) or at ``max_new_tokens`` or the window's end.

**The rows.** Prompt and completion make one window of ``block_size + 1`` tokens; only the completion's tokens
are targets (the prompt and the padding are :data:`~distlab.models.IGNORE_INDEX`), as fine-tuning records are.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from distlab.models import IGNORE_INDEX
from distlab.models.contract import contract

CHUNK = 64  # rows a generation copy scores at once


def seed_of(seed: int, rollout: int, record: int) -> int:
    """The generator seed of one prompt's group in one rollout (module docstring)."""
    return (seed * 1_000_003 + rollout) * 1_000_033 + record & (2**62 - 1)


@torch.no_grad()
def complete(model, prompt: list[int], group: int, max_new: int, temperature: float, top_p: float,
             stops: frozenset[int], seed: int) -> tuple[list[list[int]], float, int]:
    """``group`` completions of ``prompt`` (each ending with its stop token where it reached one), the sum of the
    sampling distributions' entropies over their tokens and how many tokens that is."""
    model = contract(model)
    generator = torch.Generator().manual_seed(seed)  # (on the host: the same draws on any device)
    rows = torch.tensor([prompt] * group, dtype=torch.long, device=device_of(model))
    done = torch.zeros(group, dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(group)]
    entropy, counted = 0.0, 0
    cache = None
    for step in range(max_new):
        if model.cacheable and cache is None:  # the prompt prefilled once, its cache shared by the group's rows
            logits, cache = model.decode(rows[:1], None, 0)
            logits, cache = tree_map(lambda t: shared(t, group), (logits, cache))
        elif model.cacheable:
            logits, cache = model.decode(rows[:, -1:], cache, rows.shape[1] - 1)
        else:
            logits = model(rows)
        logits = logits[:, -1].double().cpu()
        if temperature == 0:
            nxt = logits.argmax(-1)
            probs = F.one_hot(nxt, logits.shape[-1]).double()
        else:
            probs = torch.softmax((logits - logits.max(-1, keepdim=True).values) / temperature, -1)
            if top_p < 1:  # the smallest set of most likely tokens reaching top_p (the most likely always kept)
                ranked, order = probs.sort(-1, descending=True)
                drop = ranked.cumsum(-1) - ranked >= top_p
                drop[:, 0] = False
                probs = probs.scatter(-1, order, ranked.masked_fill(drop, 0.0))
                probs = probs / probs.sum(-1, keepdim=True)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        live = ~done
        entropy += float(-(probs * probs.clamp_min(1e-300).log()).sum(-1)[live].sum())
        counted += int(live.sum())
        for r in live.nonzero()[:, 0].tolist():
            out[r].append(int(nxt[r]))
            done[r] = int(nxt[r]) in stops
        if bool(done.all()) or step == max_new - 1:
            break
        rows = torch.cat([rows, nxt[:, None].to(rows.device)], 1)
    return out, entropy, counted


def shared(t, group: int):
    """A prefill's one row as ``group`` rows (a view; anything not a tensor as it is)."""
    return t.expand(group, *t.shape[1:]) if isinstance(t, torch.Tensor) and t.shape[:1] == (1,) else t


def device_of(model) -> torch.device:
    """Where ``model``'s parameters are (the generation copy is on the run's device)."""
    return next(iter(model.parameters()), torch.empty(0)).device


def window(prompt: list[int], completion: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of one row: the prompt then the completion, shifted by one, the completion's tokens
    the only targets, padded to ``block_size``."""
    seq = (prompt + completion)[:block_size + 1]
    x = torch.zeros(block_size, dtype=torch.long)
    y = torch.full((block_size,), IGNORE_INDEX, dtype=torch.long)
    x[:len(seq) - 1] = torch.tensor(seq[:-1], dtype=torch.long)
    y[len(prompt) - 1:len(seq) - 1] = torch.tensor(seq[len(prompt):], dtype=torch.long)
    return x, y


@torch.no_grad()
def token_logps(model, x: torch.Tensor, y: torch.Tensor, off=contextlib.nullcontext) -> torch.Tensor:
    """Each target's log-probability under ``model`` (0 at ignored places), ``CHUNK`` rows at a time, in
    evaluation mode; ``off``: a context the forward runs in (the base with its adapters off: the reference)."""
    was = model.training
    model.eval()
    found = torch.zeros(y.shape, dtype=torch.float64)
    with off():
        for at in range(0, len(x), CHUNK):
            logits = model(x[at:at + CHUNK].to(device_of(model))).float().cpu()
            target = y[at:at + CHUNK]
            logp = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).clamp_min(0),
                                    reduction="none").reshape(target.shape)
            found[at:at + CHUNK] = logp.double().masked_fill(target == IGNORE_INDEX, 0.0)
    model.train(was)
    return found
