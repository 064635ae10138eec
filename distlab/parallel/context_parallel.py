"""Context parallel: the sequence split over ``cp`` ranks for the whole model, attention exact.

Every layer but attention works token by token, so a rank can run them on its own tokens only;
attention needs every earlier token's key and value. Two ways to get them (``cp_style``):

**Ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the ranks pass their
key/value blocks around the ring, ``cp - 1`` hops; each rank scores its queries against every
block as it passes and merges the partial results exactly with the log-sum-exp of each block
(FlashAttention's online softmax), so no rank ever holds the whole sequence's keys or any block's
scores after its forward: backward recomputes them while the blocks go round once more, each
carrying its key/value gradient, which reaches its own rank with a last hop. Per layer and rank:
``cp - 1`` hops of ``2 x B x H x T/cp x D`` elements forward, ``2 (cp - 1) + 1`` backward. Every hop
but that last one travels while the rank scores the block it holds (the next block is sent for
before this one is used; a block's gradient goes on while the next block computes), so only what
the scoring does not hide is waited for.

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

A model joins by declaring ``context_parallel_plan(cp, style, tp)``: ``{module name: style}`` with the
styles ``context_positions`` (a module called with positions ``arange(t)``: an ``nn.Embedding`` of
positions, or a rotary table that says ``reads_positions = True``) and
``context_attention`` (a module computing attention from ``(q, k, v)``, ``(B, H, t, D)``: causal,
or over every key where the module has ``causal = False``, an encoder's)
and ``context_sequence_stats`` (a module with a ``sequence_group`` attribute, set to the
context-parallel group, over which it completes statistics of whole sequences: a mixture of
experts' routing counts).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from distlab.comm import p2p
from distlab.errors import ConfigError, with_article
from distlab.models import plans
from distlab.models.contract import SequenceStatistics, attend, contract
from distlab.parallel.cost import Call, CallGroup, Price, in_stage, under
from distlab.parallel.protocols import ComponentKind
from distlab.parallel.ring_attention import RingAttentionFunction
from distlab.parallel.ring_attention_plain import PlainRingAttention
from distlab.runtime import group_rank, group_size, timeline
from distlab.runtime.eager import eager

STYLES = ("ring", "ulysses", "ring_plain")  # ring_plain: the ring as the idea reads (ring_attention_plain)


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

    # -- the Engine's ModelSharding component: every batch cut to this rank's tokens; the gradients of
    # -- the (replicated) model are summed over the CP ranks by the gradient sync's replica group
    lockstep = False

    def prepare_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.shard(*tensors)

    def reduce_gradients(self) -> None:
        pass


class ContextPositions:
    """Makes a position embedding, called with this rank's local positions ``0..t-1``, return the
    rows of their global positions (the layout's chunks): a forward pre-hook on the embedding, so
    the module, its parameter and its key stay what they were."""

    def __init__(self, layout: ContextLayout):
        self.layout = layout

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        local = args[0]
        t = local.numel() * self.layout.cp
        return (self.layout.positions(t, device=local.device)[local],)


# --------------------------------------------------------------------------- ring attention


class RingAttention(nn.Module):
    """Attention of this rank's queries over the whole sequence, causal unless ``causal`` is False (an
    encoder's), key/value blocks passed around the context-parallel ring (module docstring)."""

    def __init__(self, group, layout: ContextLayout, causal: bool = True, window: int | None = None,
                 scale: float | None = None):
        super().__init__()
        self.group, self.layout, self.causal, self.window, self.scale = group, layout, causal, window, scale

    @eager  # a collective: run as it is under --compile (a graph break), never traced
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                records: torch.Tensor | None = None) -> torch.Tensor:
        """``records`` ``(B, T)``: a packed window's record of every position of the whole sequence -- each
        query sees its own record's keys only, and a block pair whose chunks share none is not computed. A sliding
        ``window``: a block pair wholly before it is not computed, one it cuts is masked at its band."""
        if self.window is not None and not self.causal:
            raise ConfigError("a sliding window is a causal attention's: this attention sees every key")
        if self.scale is not None:  # scores scaled by ``scale``: the queries carry it over the 1 / sqrt(D) the ring uses
            q = q * (self.scale * math.sqrt(q.shape[-1]))
        window = self.window if self.window is not None and self.window < q.shape[2] * self.layout.cp else None
        return RingAttentionFunction.apply(q, k, v, self.group, self.layout, self.causal, records, window)


# --------------------------------------------------------------------------- Ulysses


def _all_to_all(chunks: list[torch.Tensor], group, rank: int, n: int) -> list[torch.Tensor]:
    """Chunk ``j`` to rank ``j``; returns what each rank sent this one (in rank order)."""
    out = [torch.empty(c.shape, dtype=c.dtype, device=c.device) for c in chunks]
    out[rank] = chunks[rank]
    works = []
    for j in range(n):
        if j != rank:
            works.append(p2p.irecv(out[j], j, group))
    for j in range(n):
        if j != rank:
            works.append(p2p.isend(chunks[j].contiguous(), j, group))
    sent = sum(c.numel() * c.element_size() for c in chunks)
    with timeline.span(f"context-parallel all-to-all {timeline.size_text(sent)}", "communication"):
        p2p.wait_all(works)
    return out


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``split`` into ``n`` pieces, piece ``j`` to rank ``j``, and concatenate what
    arrives along ``cat``. Sequence -> heads is ``split=1`` (heads), ``cat=2`` (tokens, in rank order);
    heads -> sequence the reverse. Backward: the same exchange with the dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, rank, n, split, cat):
        ctx.args = (group, rank, n, split, cat)
        return torch.cat(_all_to_all(list(x.chunk(n, dim=split)), group, rank, n), dim=cat)

    @staticmethod
    def backward(ctx, grad):
        group, rank, n, split, cat = ctx.args
        return _AllToAll.apply(grad, group, rank, n, cat, split), None, None, None, None, None


class UlyssesAttention(nn.Module):
    """Attention, causal unless ``causal`` is False, with the heads split over the context-parallel ranks
    for its duration (module docstring)."""

    def __init__(self, group, layout: ContextLayout, causal: bool = True, window: int | None = None,
                 scale: float | None = None):
        super().__init__()
        self.group, self.layout, self.causal, self.window, self.scale = group, layout, causal, window, scale

    @eager  # a collective: run as it is under --compile (a graph break), never traced
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                records: torch.Tensor | None = None) -> torch.Tensor:
        """``records`` ``(B, T)``: a packed window's record of every position -- the document mask on the
        gathered sequence."""
        n, rank = self.layout.cp, self.layout.rank
        if q.shape[1] % n or k.shape[1] % n:
            raise ConfigError(f"context parallel (ulysses) gives each of `cp` {n} ranks whole heads: {q.shape[1]} "
                              f"query / {k.shape[1]} key-value heads (per tensor-parallel rank) do not divide; use "
                              f"--cp-style ring")
        t = q.shape[2] * n
        order = torch.cat([self.layout.positions(t, r, q.device) for r in range(n)])  # gathered tokens' positions
        back = torch.argsort(order)  # gathered order -> sequence order
        # (B, H, t, D) -> (B, H/n, n t, D): every rank's tokens (rank order, then sequence order), my heads
        q, k, v = (_AllToAll.apply(z, self.group, rank, n, 1, 2).index_select(2, back) for z in (q, k, v))
        y = attend(q, k, v, self.causal, self.window, self.scale, records).index_select(2, order)  # (a window: its band)  # back to the gathered order: rank r's tokens at block r
        return _AllToAll.apply(y, self.group, rank, n, 2, 1)


# --------------------------------------------------------------------------- the plan


def plan_of(model: nn.Module, cp: int = 2, style: str = "ring", tp: int = 1) -> dict[str, str]:
    """``model``'s context-parallel plan for ``cp`` ranks (:func:`distlab.models.plans.plan_of`): it must
    name its attention."""
    plan = plans.plan_of(model, "context", cp=cp, style=style, tp=tp)
    if "context_attention" not in plan.values():
        raise ConfigError(f"{type(model).__name__}'s context-parallel plan must name its attention "
                          f"(context_attention) and may name positions (context_positions); it has "
                          f"{', '.join(sorted(set(plan.values())))}")
    return plan


class ContextParallel(ComponentKind):
    """The component kind (:mod:`distlab.parallel.components`): ``cp=N`` splits every sequence over the
    mesh's context-parallel group; the component is the :class:`ContextLayout` that cuts each batch."""

    name = dim = "cp"

    @staticmethod
    def check(model: nn.Module, strategy, input_shape: tuple[int, ...]) -> None:
        """Before launch, on the model built on the meta device: it declares a plan for this layout (its
        own limits hold: the model raises, naming them), and a sequence of the data cuts into 2 x cp chunks."""
        plan_of(model, strategy.cp, _planned(strategy.cp_style), strategy.tp)
        if len(input_shape) == 1:  # token windows: (T,)
            ContextLayout(strategy.cp, 0).check(input_shape[0])

    @staticmethod
    def _ring_hops(t, t_rank, lay, share: float, micro: int, again) -> list[CallGroup]:
        """Per attention of the stage and micro-batch, the ring's hops as they run: forward, ``cp - 1`` hops
        of the rank's keys and values, each beside the scoring of one step's blocks (two of ``(T / 2 cp)^2``
        query-key pairs under the mask, four without); backward, ``cp - 1`` of keys and values ahead with
        gradients behind, beside that step's backward (five products to the forward's two); the gradients'
        last hop home with nothing beside it."""
        cp, steps, out = lay.cp, lay.strategy.micro_steps, []
        for name, nbytes in t.attention_kv.items():
            if not in_stage(name, t_rank, lay):
                continue
            kv = nbytes * share
            pair = t.attention_flops.get(name, 0.0) * micro / lay.tp / (2 * cp) ** 2  # one block pair's forward
            scored = pair * (2 if t.attention_causal else 4)
            hop = dict(ranks=2, local=lay.dp > 1, dim="cp")
            out += [CallGroup([Call("native", "send", kv)], hops=(cp - 1) * again(name) * steps, hidden_flops=scored,
                              **hop),
                    CallGroup([Call("native", "send", 2 * kv)], hops=(cp - 1) * steps, hidden_flops=2.5 * scored, **hop),
                    CallGroup([Call("native", "send", kv)], hops=steps, **hop)]
        return out

    @staticmethod
    def price(t, t_rank, lay, micro: int, optim) -> Price:
        """On the model's trace: its keys and values are ``1 / (cp tp)`` of the model's; per attention
        and micro-batch the ring sends ``3 cp - 2`` of them (``cp - 1`` hops forward, ``2 (cp - 1) + 1``
        backward), Ulysses ``(cp - 1) / cp`` of its queries, keys, values and output each way (4
        all-to-alls forward, 4 backward; queries and output outweigh keys and values under grouped-query
        attention), on the critical path of every attention, over a node's links where the data-parallel
        size is 1."""
        if not t.attention_kv_bytes_per_sample:
            raise ConfigError(f"`cp` {lay.cp}: context parallel splits a transformer's sequences, and this model "
                              f"declares no attention (context_parallel_plan); plan it with `cp` 1")
        if lay.strategy.cp_style == "ring_plain":
            raise ConfigError("`cp_style` ring_plain is not planned: plan the tuned ring (`cp_style` ring), which the "
                              "plain one equals in what it computes")
        cp, ring = lay.cp, lay.strategy.cp_style == "ring"
        recomputed = {n for block in lay.strategy.checkpointed(t.blocks) for n in block}

        def again(name: str) -> int:  # an attention inside a checkpointed block runs its forward twice
            return 1 + under(name, recomputed)

        mine = sum(v for name, v in t.attention_kv.items() if in_stage(name, t_rank, lay)) if t.attention_kv else \
            t.attention_kv_bytes_per_sample
        mine_again = sum(v * (again(name) - 1) for name, v in t.attention_kv.items() if in_stage(name, t_rank, lay))
        # this rank's keys and values, every attention of its stage (a tensor-parallel rank's share: 1/tp, or the
        # heads it keeps where tp does not divide them)
        share = micro / cp * t.kv_share.get(lay.tp, 1 / lay.tp)
        kv, kv_again = mine * share, mine_again * share
        q = sum(v for name, v in t.attention_q.items() if in_stage(name, t_rank, lay)) * micro / (cp * lay.tp) \
            if t.attention_q else kv / 2
        q_again = sum(v * (again(name) - 1) for name, v in t.attention_q.items() if in_stage(name, t_rank, lay)) \
            * micro / (cp * lay.tp) if t.attention_q else kv_again / 2
        sent = ((3 * cp - 2) * kv if ring else 2 * (cp - 1) / cp * (2 * q + kv))
        sent += (cp - 1) * kv_again if ring else (cp - 1) / cp * (2 * q_again + kv_again)  # recomputed forwards
        sent *= lay.strategy.micro_steps
        calls = (ContextParallel._ring_hops(t, t_rank, lay, share, micro, again) if ring and t.attention_kv
                 else [CallGroup([Call("native", "send", sent)], 2, local=lay.dp > 1, dim="cp")])
        return Price(calls, compute_split=cp, report={
            "context_parallel": {
                "cp": cp, "style": lay.strategy.cp_style, "bytes_per_step_per_rank": int(sent),
                "tokens_per_rank_share": 1 / cp,
                "bytes_basis": ("ring: per attention and micro-batch, cp - 1 hops of the rank's keys and values "
                                "forward, 2 (cp - 1) + 1 backward (their gradients a hop behind, then home); every "
                                "hop but that last one beside a step's scoring" if ring
                                else "ulysses: per attention and micro-batch, 4 all-to-alls forward (q, k, v, out) "
                                "and 4 backward, each sending (cp - 1) / cp of the rank's tensor (queries and "
                                "output as large as the query heads, keys and values as their groups)"),
                "attention_balance": "rank c holds chunks c and 2cp - 1 - c of 2cp: every rank scores the same "
                                     "number of query-key pairs under the causal mask" if t.attention_causal else
                                     "no mask (an encoder's attention): every rank scores its queries against every "
                                     "key, the same number of pairs; the keys and values travel as under a mask"}},
            activation_note=f", each rank holding 1/{cp} of every sequence's tokens (context parallel)"
                            + ("; the ring's attention keeping its output and log-sum-exp, not its scores" if ring and
                               t.attention == "math" else ""),
            activation_extra=-sum(v for name, v in t.attention_scores.items() if in_stage(name, t_rank, lay)
                                  and not again(name) - 1) * micro / (cp * lay.tp) if ring and t.attention == "math"
            else 0.0)

    @staticmethod
    def describe(engine) -> list[str]:
        """How each sequence is shared out: the style and the chunks each rank holds."""
        cp, style = engine.mesh.cp, engine.strategy.cp_style
        return [f"context parallel: each sequence split over {cp} ranks ({style}: 1/{cp} of its tokens each, "
                f"chunks c and {2 * cp - 1}-c of {2 * cp})"]

    @staticmethod
    def apply(model: nn.Module, strategy, mesh) -> tuple[nn.Module, ContextLayout]:
        return model, apply_context_parallel(model, mesh.cp_group, strategy.cp_style, strategy.tp)


def replacement(module: nn.Module, group, layout: ContextLayout, style: str) -> nn.Module:
    """What a ``context_attention`` module becomes: the ring's or the all-to-all's attention, causal
    unless the module says ``causal = False`` (an encoder's attention)."""
    core = contract(module)
    kind = {"ring": RingAttention, "ring_plain": PlainRingAttention, "ulysses": UlyssesAttention}[style]
    return kind(group, layout, core.causal, core.window, core.scale)


def _planned(style: str) -> str:
    """The style a model's plan is asked for (the plain ring's modules are the ring's)."""
    return "ring" if style == "ring_plain" else style


def apply_context_parallel(model: nn.Module, group, style: str = "ring", tp: int = 1) -> ContextLayout:
    """Make ``model`` run on this rank's tokens of each sequence, as its plan says, in place; returns
    the layout the batch must be cut with."""
    if style not in STYLES:
        raise ConfigError(f"unknown `cp_style` {style!r}; choose one of: {', '.join(STYLES)}")
    layout = ContextLayout(group_size(group), group_rank(group))
    for name, kind in plan_of(model, layout.cp, _planned(style), tp).items():
        module = model.get_submodule(name)
        if kind == "context_positions":
            if not (isinstance(module, nn.Embedding) or contract(module).reads_positions):
                raise ConfigError(f"context-parallel plan: {name} is {with_article(type(module).__name__)}, but "
                                  f"context_positions applies to a module called with positions 0..t-1 (an "
                                  f"nn.Embedding of positions, or one that says reads_positions = True: a rotary "
                                  f"table)")
            module.register_forward_pre_hook(ContextPositions(layout))
            continue
        if kind == "context_sequence_stats":
            if not isinstance(module, SequenceStatistics):
                raise ConfigError(f"context-parallel plan: {name} ({type(module).__name__}) is no SequenceStatistics "
                                  f"(distlab.models.contract) to complete its per-sequence statistics over the "
                                  f"sequence's ranks")
            module.sequence_group = group
            continue
        new = replacement(module, group, layout, style)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return layout


def ring_bytes(batch: int, heads: int, t: int, head_dim: int, cp: int, itemsize: int = 4) -> int:
    """Bytes one rank sends per attention layer and step (ring style): forward, ``cp - 1`` hops of its
    keys and values; backward, ``cp - 1`` hops of keys, values and their gradients, and the last hop
    of the gradients home -- ``3 cp - 2`` times one rank's keys and values."""
    kv = 2 * batch * heads * (t // cp) * head_dim * itemsize
    return ((cp - 1) + 2 * (cp - 1) + 1) * kv if cp > 1 else 0


def ulysses_bytes(batch: int, heads: int, t: int, head_dim: int, cp: int, itemsize: int = 4) -> int:
    """Bytes one rank sends per attention layer and step, forward and backward (Ulysses style)."""
    return 2 * 4 * (cp - 1) * batch * (heads // cp) * (t // cp) * head_dim * itemsize
