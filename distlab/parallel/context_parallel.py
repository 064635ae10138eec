"""Context parallel: the sequence split over ``cp`` ranks for the whole model, attention exact.

Every layer but attention works token by token, so a rank can run them on its own tokens only;
attention needs every earlier token's key and value. Two ways to get them (``cp_style``):

**Ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the ranks pass their
key/value blocks around the ring, ``cp - 1`` hops; each rank scores its queries against every
block as it passes and merges the partial results exactly with the log-sum-exp of each block
(the online softmax of FlashAttention), so no rank ever holds the whole sequence's keys or the
``T x T`` scores. Backward runs the same ring the other way: each hop's gradient goes back to the
rank the block came from. Per layer and rank: ``(cp - 1) x 2 x B x H x T/cp x D`` elements
forward and as many backward.

**Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns the queries, keys and
values from "my tokens, every head" into "every token, my heads" (``H / cp`` heads each), plain
causal attention runs on whole sequences, and a second all-to-all turns the output back. Per
layer and rank: 4 all-to-alls of ``(cp - 1)/cp x B x H x T/cp x D`` elements forward (q, k, v,
out) and 4 backward. Needs the heads (per tensor-parallel rank) to divide by ``cp``.

**Load balance.** A causal mask gives a query at the end of the sequence ``T`` keys to score and
one at the start one, so contiguous shards would leave rank 0 idle while the last rank works.
The sequence is cut into ``2 cp`` chunks and rank ``c`` takes chunks ``c`` and ``2 cp - 1 - c``
(a short one and its mirror): every rank scores the same number of query-key pairs, and the ring
skips blocks that the mask empties entirely. :class:`ContextLayout` holds this map; the batch is
cut with it before the model runs (:meth:`ContextLayout.shard`), the position embedding reads
the global positions of the rank's tokens (:class:`ContextPositions`), and the loss is the mean
over the rank's tokens -- the same count on every rank, so averaging the gradients over the
data- and context-parallel ranks together gives the whole sequence's mean.

A model joins by declaring ``context_parallel_plan()``: ``{module name: style}`` with the
styles ``context_positions`` (an ``nn.Embedding`` of positions, called with ``arange(t)``) and
``context_attention`` (a module computing causal attention from ``(q, k, v)``, ``(B, H, t, D)``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from distlab.comm import p2p
from distlab.errors import ConfigError
from distlab.runtime import group_rank, group_size

STYLES = ("ring", "ulysses")
PLAN_STYLES = ("context_positions", "context_attention")


class ContextLayout:
    """Which tokens of a sequence rank ``rank`` of ``cp`` holds: chunks ``rank`` and ``2 cp - 1 - rank``
    of ``2 cp`` equal chunks."""

    def __init__(self, cp: int, rank: int):
        self.cp, self.rank = cp, rank

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r, 2 * self.cp - 1 - r

    def check(self, t: int) -> None:
        if t % (2 * self.cp):
            raise ConfigError(f"context parallel cuts each sequence into 2 x `cp` = {2 * self.cp} equal chunks: "
                              f"{t} tokens do not divide (choose a `block_size` that {2 * self.cp} divides)")

    def positions(self, t: int, rank: int | None = None, device=None) -> torch.Tensor:
        """The global positions (of a ``t``-token sequence) that ``rank``'s tokens have, in its order."""
        self.check(t)
        size = t // (2 * self.cp)
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks(rank)])

    def shard(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's tokens of each ``(B, T, ...)`` tensor (inputs and targets alike)."""
        t = tensors[0].shape[1]
        index = self.positions(t, device=tensors[0].device)
        return tuple(x.index_select(1, index) for x in tensors)


class ContextPositions(nn.Module):
    """A position embedding that, called with this rank's local positions ``0..t-1``, returns the
    rows of their global positions (the layout's chunks)."""

    def __init__(self, pos: nn.Embedding, layout: ContextLayout):
        super().__init__()
        self.pos, self.layout = pos, layout

    @property
    def weight(self) -> nn.Parameter:
        return self.pos.weight

    @property
    def num_embeddings(self) -> int:
        return self.pos.num_embeddings

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        t = local.numel() * self.layout.cp
        return self.pos(self.layout.positions(t, device=local.device)[local])


# --------------------------------------------------------------------------- ring attention


class _RingPass(torch.autograd.Function):
    """Forward: send to the next rank of the ring, receive from the previous one. Backward: the
    gradient goes the other way (to the previous rank, from the next)."""

    @staticmethod
    def forward(ctx, x, group, rank, n):
        ctx.group, ctx.rank, ctx.n = group, rank, n
        out = torch.empty_like(x)
        p2p.exchange(x.contiguous(), (rank + 1) % n, out, (rank - 1) % n, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        p2p.exchange(grad.contiguous(), (ctx.rank - 1) % ctx.n, out, (ctx.rank + 1) % ctx.n, ctx.group)
        return out, None, None, None


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one key/value block: (output normalised within the block, log-sum-exp
    of each query's scores), ``(B, H, tq, D)`` and ``(B, H, tq, 1)``."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:  # the diagonal block: query i sees keys 0..i of it
        t = scores.shape[-1]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Blockwise results merged exactly: softmax over all keys = each block's weighted by its share."""
    lse = torch.logsumexp(torch.cat([l for _, l in parts], dim=-1), dim=-1, keepdim=True)
    return sum(torch.exp(l - lse) * o for o, l in parts)


class RingAttention(nn.Module):
    """Causal attention of this rank's queries over the whole sequence, key/value blocks passed
    around the context-parallel ring (module docstring)."""

    def __init__(self, group, layout: ContextLayout):
        super().__init__()
        self.group, self.layout = group, layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, rank = self.layout.cp, self.layout.rank
        half = q.shape[2] // 2
        queries = [(q[:, :, :half], self.layout.chunks()[0]), (q[:, :, half:], self.layout.chunks()[1])]
        parts: list[list] = [[], []]
        kv = torch.stack([k, v])  # one message per hop
        for step in range(n):
            owner = (rank - step) % n  # whose keys and values this rank holds now
            if step:
                kv = _RingPass.apply(kv, self.group, rank, n)
            for (kc, vc), chunk in zip(((kv[0, :, :, :half], kv[1, :, :, :half]),
                                        (kv[0, :, :, half:], kv[1, :, :, half:])), self.layout.chunks(owner)):
                for i, (qc, q_chunk) in enumerate(queries):
                    if chunk < q_chunk:
                        parts[i].append(_block(qc, kc, vc, causal=False))
                    elif chunk == q_chunk:
                        parts[i].append(_block(qc, kc, vc, causal=True))
                    # chunk > q_chunk: every key is after every query -- the mask empties it, skip
        return torch.cat([_merge(parts[0]), _merge(parts[1])], dim=2)


# --------------------------------------------------------------------------- Ulysses


def _all_to_all(chunks: list[torch.Tensor], group, rank: int, n: int) -> list[torch.Tensor]:
    """Chunk ``j`` to rank ``j``; returns what each rank sent this one (in rank order)."""
    out = [torch.empty_like(c) for c in chunks]
    out[rank] = chunks[rank]
    works = []
    for j in range(n):
        if j != rank:
            works.append(p2p.irecv(out[j], j, group))
    for j in range(n):
        if j != rank:
            works.append(p2p.isend(chunks[j].contiguous(), j, group))
    p2p.wait_all(works)
    return out


class _SequenceToHeads(torch.autograd.Function):
    """``(B, H, t, D)`` on each rank (its tokens, every head) -> ``(B, H/n, n t, D)`` (every rank's
    tokens, in rank order, for this rank's heads). Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, rank, n):
        ctx.group, ctx.rank, ctx.n = group, rank, n
        return torch.cat(_all_to_all(list(x.chunk(n, dim=1)), group, rank, n), dim=2)

    @staticmethod
    def backward(ctx, grad):
        return _HeadsToSequence.apply(grad, ctx.group, ctx.rank, ctx.n), None, None, None


class _HeadsToSequence(torch.autograd.Function):
    """The inverse of :class:`_SequenceToHeads`."""

    @staticmethod
    def forward(ctx, x, group, rank, n):
        ctx.group, ctx.rank, ctx.n = group, rank, n
        return torch.cat(_all_to_all(list(x.chunk(n, dim=2)), group, rank, n), dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _SequenceToHeads.apply(grad, ctx.group, ctx.rank, ctx.n), None, None, None


class UlyssesAttention(nn.Module):
    """Causal attention with the heads split over the context-parallel ranks for its duration
    (module docstring)."""

    def __init__(self, group, layout: ContextLayout):
        super().__init__()
        self.group, self.layout = group, layout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, rank = self.layout.cp, self.layout.rank
        if q.shape[1] % n:
            raise ConfigError(f"context parallel (ulysses) gives each of `cp` {n} ranks whole heads: {q.shape[1]} "
                              f"heads (per tensor-parallel rank) do not divide; use --cp-style ring")
        t = q.shape[2] * n
        order = torch.cat([self.layout.positions(t, r, q.device) for r in range(n)])  # gathered tokens' positions
        back = torch.argsort(order)  # gathered order -> sequence order
        q, k, v = (_SequenceToHeads.apply(z, self.group, rank, n).index_select(2, back) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.index_select(2, order)  # back to the gathered order: rank r's tokens at block r
        return _HeadsToSequence.apply(y, self.group, rank, n)


# --------------------------------------------------------------------------- the plan


def plan_of(model: nn.Module) -> dict[str, str]:
    declared = getattr(model, "context_parallel_plan", None)
    if declared is None:
        raise ConfigError(f"`cp` splits the sequence of a model that names its position embedding and attention in "
                          f"a context_parallel_plan() method; {type(model).__name__} has none (the built-in gpt has)")
    plan = dict(declared())
    unknown = sorted({s for s in plan.values() if s not in PLAN_STYLES})
    if unknown or "context_attention" not in plan.values():
        raise ConfigError(f"{type(model).__name__}'s context-parallel plan must name its attention "
                          f"(context_attention) and may name positions (context_positions); it has "
                          f"{', '.join(sorted(set(plan.values()))) or 'nothing'}")
    return plan


def apply_context_parallel(model: nn.Module, group, style: str = "ring") -> ContextLayout:
    """Make ``model`` run on this rank's tokens of each sequence, as its plan says, in place; returns
    the layout the batch must be cut with."""
    if style not in STYLES:
        raise ConfigError(f"unknown `cp_style` {style!r}; choose one of: {', '.join(STYLES)}")
    layout = ContextLayout(group_size(group), group_rank(group))
    for name, kind in plan_of(model).items():
        module = model.get_submodule(name)
        if kind == "context_positions":
            if not isinstance(module, nn.Embedding):
                raise ConfigError(f"context-parallel plan: {name} is a {type(module).__name__}, but "
                                  f"context_positions applies to an nn.Embedding of positions")
            new = ContextPositions(module, layout)
        else:
            new = (RingAttention if style == "ring" else UlyssesAttention)(group, layout)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return layout


def ring_bytes(batch: int, heads: int, t: int, head_dim: int, cp: int, itemsize: int = 4) -> int:
    """Bytes one rank sends per attention layer and step, forward and backward (ring style)."""
    return 2 * (cp - 1) * 2 * batch * heads * (t // cp) * head_dim * itemsize


def ulysses_bytes(batch: int, heads: int, t: int, head_dim: int, cp: int, itemsize: int = 4) -> int:
    """Bytes one rank sends per attention layer and step, forward and backward (Ulysses style)."""
    return 2 * 4 * (cp - 1) * batch * (heads // cp) * (t // cp) * head_dim * itemsize
