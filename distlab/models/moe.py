"""Mixture of experts: a router sends each token to ``top_k`` of ``experts`` feed-forward networks.

:class:`MoE` replaces a transformer block's MLP (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch, Fedus et al. 2021; Mixtral's top-2 of 8). Per token: the router's softmax over the
experts, the ``top_k`` largest probabilities renormalised to sum to one as the gates, the
token's output the gate-weighted sum of its experts' outputs.

**Dropless by default.** Every token reaches all of its experts, however unbalanced the routing:
no token's output depends on which other tokens share its batch, so a run split over ranks in
any way computes what one process computes on the whole batch. With a ``capacity_factor`` an
expert takes at most ``ceil(capacity_factor x slots / experts)`` of the token-slots a forward
routes (``slots = tokens x top_k``): with ``drop_policy`` ``position`` the earliest first, with
``probs`` (DeepSpeed's and Megatron-LM's default) those the router gave the expert the highest
probability, the earliest first among equals; the rest are dropped (they add nothing; the residual
carries the token on) and counted. Drops depend on which tokens share a forward --
each rank's micro-batch -- so a capacity-limited run equals one process only where nothing is
dropped.

**Load-balancing loss, per sequence.** Routing collapses onto a few experts unless training is
told to spread it. The auxiliary loss is Switch's ``E x sum_e f_e P_e`` (``f_e``: the fraction
of slots routed to expert ``e``; ``P_e``: its mean router probability), computed for each
*sequence* and averaged over sequences (the sequence-wise balance loss of DeepSeek-V3). Per
sequence, it splits over data-parallel ranks, micro-batches and pipeline stages exactly like
the task loss does -- a mean over samples -- so every layout trains the single-process model.
Only context and sequence parallel, which split a sequence itself, complete ``f`` with one
all-reduce of the counts over their ranks (:attr:`MoE.sequence_group`; under sequence parallel the
gradients are summed over the group, not averaged, so each rank's share is scaled by its tokens). The loss reaches the router without passing
through the model's output: its gradient (``aux_coef`` times the forward's share of the step, which
the schedule running the micro-batches sets: :mod:`distlab.models.aux_loss`) is added in backward where the layer's output is (Megatron-LM's
``MoEAuxLossAutoScaler`` does the same), so a pipeline stage needs no extra loss term.

**The experts** are one :class:`GroupedExperts` module holding them stacked (``(E, d, h)``
weights), fed the routed tokens sorted by expert with the count of each. Expert parallel
(:mod:`distlab.parallel.expert_parallel`) swaps it for a shard of ``E / ep`` experts that
exchanges tokens with all-to-all; the router and the combination stay here.

**Statistics.** Each training forward adds its routed slots per expert to :attr:`MoE.load` and
its dropped slots to :attr:`MoE.dropped` (recomputation under activation checkpointing does not
count twice); :attr:`MoE.last_aux` is the last balance loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError
from distlab.models.aux_loss import current_share
from distlab.models.contract import SequenceStatistics
from distlab.models.spec import Options, option

DROP_POLICIES = ("position", "probs")  # which slots a full expert keeps: the earliest, or the most probable


class Experts(nn.Module):
    """Experts stored stacked along a first dimension of size ``experts``; ``forward(tokens, counts)``."""

    def active_weights(self) -> int:
        """Weights one token passes through in one expert (for FLOPs per token)."""
        return sum(p[0].numel() for name, p in self.named_parameters() if name.endswith("weight"))


class GroupedExperts(Experts):
    """``experts`` two-layer GELU MLPs ``d -> hidden -> d`` stored stacked: ``up_weight (E, d, h)``,
    ``up_bias (E, h)``, ``down_weight (E, h, d)``, ``down_bias (E, d)``. ``forward(tokens, counts)``:
    ``tokens`` sorted by expert, ``counts[e]`` of them for expert ``e``; returns their outputs in
    the same order."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.up_weight = nn.Parameter(torch.empty(experts, dim, hidden))
        self.up_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.down_weight = nn.Parameter(torch.empty(experts, hidden, dim))
        self.down_bias = nn.Parameter(torch.zeros(experts, dim))
        for w in (self.up_weight, self.down_weight):
            nn.init.normal_(w, 0.0, 0.02)

    @property
    def num_experts(self) -> int:
        return self.up_weight.shape[0]

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for e, piece in enumerate(tokens.split(counts)):
            if len(piece):
                h = F.gelu(piece @ self.up_weight[e] + self.up_bias[e])
                outs.append(h @ self.down_weight[e] + self.down_bias[e])
        if not outs:  # nothing routed here: an empty result still joins the graph of the tokens and every expert
            joined = tokens.sum() + sum(p.sum() for p in self.parameters())
            return tokens.new_zeros(0, self.down_weight.shape[-1]) + 0 * joined
        return torch.cat(outs)


class SwiGLUExperts(Experts):
    """``experts`` SwiGLU MLPs ``down(silu(x gate) * (x up))`` stored stacked, no biases (the Llama family's):
    ``gate_weight``, ``up_weight (E, d, h)``, ``down_weight (E, h, d)``; ``forward`` as
    :class:`GroupedExperts`'."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_weight = nn.Parameter(torch.empty(experts, dim, hidden))
        self.up_weight = nn.Parameter(torch.empty(experts, dim, hidden))
        self.down_weight = nn.Parameter(torch.empty(experts, hidden, dim))
        for w in (self.gate_weight, self.up_weight, self.down_weight):
            nn.init.normal_(w, 0.0, 0.02)

    @property
    def num_experts(self) -> int:
        return self.up_weight.shape[0]

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for e, piece in enumerate(tokens.split(counts)):
            if len(piece):
                outs.append((F.silu(piece @ self.gate_weight[e]) * (piece @ self.up_weight[e])) @ self.down_weight[e])
        if not outs:  # nothing routed here: an empty result still joins the graph of the tokens and every expert
            joined = tokens.sum() + sum(p.sum() for p in self.parameters())
            return tokens.new_zeros(0, self.down_weight.shape[-1]) + 0 * joined
        return torch.cat(outs)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, the balance loss ``aux`` receives the gradient ``scale``
    as if ``scale x aux`` had been added to the loss."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def _recomputing() -> bool:
    """Whether this forward runs inside backward (activation checkpointing's recomputation)."""
    return torch._C._current_graph_task_id() != -1


class MoE(SequenceStatistics):
    """A mixture-of-experts feed-forward layer on ``(B, T, d)`` (module docstring)."""

    def __init__(self, dim: int, experts: int, top_k: int = 2, hidden: int | None = None,
                 capacity_factor: float | None = None, aux_coef: float = 0.01, drop_policy: str = "position",
                 expert_kind: type = GroupedExperts):
        super().__init__()
        if experts < 2:
            raise ValueError(f"a mixture of experts needs at least 2 experts, not {experts}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k {top_k} must be between 1 and the number of experts {experts}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive, not {capacity_factor}")
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {', '.join(DROP_POLICIES)}, not {drop_policy!r}")
        self.num_experts, self.top_k, self.drop_policy = experts, top_k, drop_policy
        self.capacity_factor, self.aux_coef = capacity_factor, aux_coef
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = expert_kind(experts, dim, hidden or 4 * dim)
        self.sequence_group = None  # context or sequence parallel: the ranks holding the other parts of each sequence
        self.sequence_grad = "mean"  # how their gradients combine: averaged (context parallel) or summed (sequence)
        self.reset_statistics()

    def reset_statistics(self) -> None:
        self.load = torch.zeros(self.num_experts, dtype=torch.float64, device="cpu")  # slots per expert (host)
        self.dropped = 0  # slots dropped by the capacity limit
        self.routed = 0   # slots routed (dropped ones included)
        self.last_aux: torch.Tensor | None = None

    def capacity(self, slots: int) -> int | None:
        """The most slots an expert takes from a forward routing ``slots`` (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * slots / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        logits = self.router(flat)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)  # (N, E), at least fp32
        gates, chosen = probs.topk(self.top_k, dim=-1)                       # (N, k)
        gates = gates / gates.sum(-1, keepdim=True)
        expert_of = chosen.reshape(-1)                                       # slot -> expert
        order = torch.argsort(expert_of, stable=True)                        # slots by expert, then token
        if x.is_meta:  # traced without data (distlab plan): routing assumed balanced, nothing dropped
            return self._balanced(x, flat, order, gates)
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        kept, kept_counts = order, counts
        cap = self.capacity(len(expert_of))
        if cap is not None:
            if self.drop_policy == "probs":  # at each expert, its most probable slots first (then the earliest)
                by_prob = torch.argsort(-probs.gather(1, chosen).reshape(-1), stable=True)
                order = by_prob[torch.argsort(expert_of[by_prob], stable=True)]
            start = torch.cumsum(counts, 0) - counts
            position = torch.arange(len(order), device=x.device) - start[expert_of[order]]
            keep = position < cap
            kept, kept_counts = order[keep], counts.clamp(max=cap)
        token_of = kept // self.top_k
        out = self.experts(flat[token_of], kept_counts.tolist())
        weighted = out * gates.reshape(-1)[kept].unsqueeze(-1).to(out.dtype)
        y = torch.zeros((b * t, d), dtype=weighted.dtype, device=x.device).index_add_(0, token_of, weighted)
        if self.training and torch.is_grad_enabled():
            aux = self._balance_loss(probs.view(b, t, -1), chosen.view(b, t, -1))
            y = _AuxLossGrad.apply(y, aux, self.aux_coef * current_share())
            if not _recomputing():
                self.last_aux = aux.detach()
                self.load += counts.detach().to("cpu", torch.float64)
                self.routed += len(expert_of)
                self.dropped += len(expert_of) - len(kept)
        return y.view(b, t, d).to(x.dtype)

    def _balanced(self, x, flat, order, gates) -> torch.Tensor:
        """The forward's shapes and operations with every expert given an equal share of the slots."""
        slots, e = len(order), self.num_experts
        counts = [slots // e + (i < slots % e) for i in range(e)]
        token_of = order // self.top_k
        out = self.experts(flat[token_of], counts)
        weighted = out * gates.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(flat, dtype=weighted.dtype).index_add_(0, token_of, weighted).view(x.shape).to(x.dtype)

    def _balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``mean over sequences of E x sum_e f_e P_e`` with ``f`` over the whole sequence (summed over
        :attr:`sequence_group`) and ``P`` over this rank's tokens of it."""
        b, t, e = probs.shape
        seq = torch.arange(b, device=probs.device).repeat_interleave(t * self.top_k)
        f = torch.bincount(seq * e + chosen.reshape(-1), minlength=b * e).view(b, e).to(probs.dtype)
        tokens = t
        if self.sequence_group is not None and dist.get_world_size(self.sequence_group) > 1:
            dist.all_reduce(f, group=self.sequence_group)
            tokens = t * dist.get_world_size(self.sequence_group)
        f = f / (tokens * self.top_k)
        aux = e * (f * probs.mean(1)).sum(-1).mean()
        # summed gradients (sequence parallel) must add up to the whole sequence's mean probability
        return aux * t / tokens if self.sequence_grad == "sum" else aux

    def routing_statistics(self) -> dict:
        """This rank's routing counts since the last reset."""
        return {"load": [int(v) for v in self.load.tolist()], "routed": int(self.routed), "dropped": int(self.dropped),
                "aux_loss": None if self.last_aux is None else float(self.last_aux)}


# --------------------------------------------------------------------------- a family's options

_ROUTING = "a mixture of experts' routing"


@dataclass(frozen=True)
class ExpertOptions(Options):
    """The mixture-of-experts options of a family whose MLPs are mixtures (``gpt-moe``, ``llama-moe``): put
    first among an options class's bases, after the family's own (``class X(ExpertOptions, GPTOptions)``)."""

    experts: int = option(8, "gpt-moe: experts per mixture-of-experts layer (every block's MLP).", what=_ROUTING)
    top_k: int = option(2, "gpt-moe: experts each token is routed to (gates: the router's softmax over them, "
                        "renormalised).", what=_ROUTING)
    capacity_factor: float | None = option(None, "gpt-moe: each expert takes at most ceil(F x tokens x top_k / "
                                           "experts) token-slots per forward, the rest dropped and counted "
                                           "(default: dropless).", what=_ROUTING)
    drop_policy: str = option("position", "gpt-moe with --capacity-factor: which slots a full expert keeps -- "
                              "position (the earliest) or probs (those the router gave it the highest "
                              "probability; DeepSpeed's and Megatron-LM's default).", what=_ROUTING)
    aux_coef: float = option(0.01, "gpt-moe: weight of the per-sequence load-balancing loss.", what=_ROUTING)

    def check(self) -> None:
        super().check()
        if self.experts < 2:
            raise ConfigError(f"`experts` must be at least 2, not {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"`top_k` {self.top_k} must be between 1 and `experts` {self.experts} (each token goes "
                              f"to top_k of the experts)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"`capacity_factor` must be positive, not {self.capacity_factor:g} (leave it out for "
                              f"dropless routing)")
        if not self.aux_coef >= 0:
            raise ConfigError(f"`aux_coef` must be 0 or more, not {self.aux_coef:g}")
        if self.drop_policy not in DROP_POLICIES:
            raise ConfigError(f"unknown `drop_policy` {self.drop_policy!r}; choose one of: {', '.join(DROP_POLICIES)}")
        if self.drop_policy != "position" and self.capacity_factor is None:
            raise ConfigError(f"`drop_policy` {self.drop_policy} picks which slots a full expert drops, and without "
                              f"`capacity_factor` none is ever dropped: give `capacity_factor` (e.g. 1.25) or drop "
                              f"`drop_policy`")

    def describe(self) -> str:
        return (f"{super().describe()}, MLPs of {self.experts} experts, top-{self.top_k}, "
                + ("dropless" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}, a full "
                   f"expert keeping its {'earliest' if self.drop_policy == 'position' else 'most probable'} slots")
                + f", balance loss x {self.aux_coef:g}")

    def experts_options(self) -> dict:
        """:class:`MoE`'s keyword arguments (the drop policy named only when not the default: a snapshot of
        before it existed still resumes)."""
        return dict(experts=self.experts, top_k=self.top_k, capacity_factor=self.capacity_factor,
                    aux_coef=self.aux_coef, **({"drop_policy": self.drop_policy} if self.drop_policy != "position"
                                               else {}))
