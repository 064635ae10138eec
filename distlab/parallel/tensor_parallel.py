"""Tensor parallel linear layers (Megatron-LM, Shoeybi et al. 2019) and the naive alternative.

A linear layer ``y = x W^T + b`` with ``W`` of shape ``(out, in)`` can be split over the ``t`` ranks
of a tensor-parallel group two ways:

* **column parallel**: each rank holds ``out/t`` rows of ``W`` (output features) and computes its
  slice of ``y`` from the whole ``x``;
* **row parallel**: each rank holds ``in/t`` columns of ``W`` and, from its slice of ``x``, a
  partial ``y`` that must be summed over the group.

All communication lives in four small autograd functions (``f`` and ``g`` in the Megatron paper):

=====================  =========================  =============================
function               forward                    backward
=====================  =========================  =============================
``copy_to_group``      identity                   all-reduce the gradient
``reduce_from_group``  all-reduce                 identity
``gather_from_group``  all-gather the last dim    keep this rank's slice
``split_to_group``     keep this rank's slice     all-gather the last dim
``gather_sequence``    all-gather dim 1           reduce-scatter dim 1
``scatter_sequence``   reduce-scatter dim 1       all-gather dim 1
=====================  =========================  =============================

The last two are sequence parallel's (Korthikanti et al. 2022) replacements for ``copy_to_group``
and ``reduce_from_group`` around a block whose outside is split along the sequence (dim 1 of
``(batch, sequence, features)``): an all-gather plus a reduce-scatter move what one all-reduce does.

**Megatron style** (an MLP block ``B(act(A(x)))``): ``A`` column parallel, ``B`` row parallel --
the activation stays split between them, so a block costs one all-reduce forward (after ``B``)
and one backward (the input gradient of ``A``). **Naive style**: every layer column parallel with
its output gathered: an all-gather after every layer forward, and an all-reduce of every layer's
input gradient backward. Shards are slices of the full layer, so a model built from the same
seed and then sharded computes exactly what the unsharded one does. Which layers of a model are
split, and how, is the model's own plan (:mod:`distlab.parallel.tp_plan` applies it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab import comm
from distlab.errors import ConfigError
from distlab.runtime import group_rank, group_size, timeline

STYLES = ("megatron", "naive")


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    with timeline.span(f"tensor-parallel all-reduce {timeline.size_text(t.numel() * t.element_size())}", "communication"):
        return comm.all_reduce(t.contiguous(), op="sum", algorithm="native", group=group)


def all_gather_along(t: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (in group-rank order)."""
    n = group_size(group)
    if n == 1:
        return t
    flat = t.movedim(dim, 0).contiguous()  # gather along dim 0, then move it back
    out = torch.empty((n * flat.shape[0], *flat.shape[1:]), dtype=t.dtype, device=t.device)
    with timeline.span(f"tensor-parallel all-gather {timeline.size_text(out.numel() * out.element_size())}", "communication"):
        comm.all_gather(out, flat, algorithm="native", group=group)
    return out.movedim(0, dim).contiguous()


def _gather_last(t: torch.Tensor, group) -> torch.Tensor:
    return all_gather_along(t, group, -1)


def _reduce_scatter(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum ``t`` over the group and keep this rank's ``1/n`` slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ConfigError(f"sequence parallel: a sequence of {t.shape[dim]} does not split over `tp` {n}")
    flat = t.movedim(dim, 0).contiguous()
    out = torch.empty((flat.shape[0] // n, *flat.shape[1:]), dtype=t.dtype, device=t.device)
    with timeline.span(f"sequence-parallel reduce-scatter {timeline.size_text(flat.numel() * flat.element_size())}", "communication"):
        comm.reduce_scatter(out, flat, op="sum", algorithm="native", group=group)
    return out.movedim(0, dim).contiguous()


def _split_last(t: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    return t if n == 1 else t.chunk(n, dim=-1)[group_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_sum(g.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, group, 1)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, 1), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, 1)

    @staticmethod
    def backward(ctx, g):
        return all_gather_along(g.contiguous(), ctx.group, 1), None


@torch.compiler.disable  # a collective: run as it is under --compile (a graph break), never traced
def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the sequence forward; reduce-scatter of the gradient backward."""
    return _GatherSequence.apply(x, group)


@torch.compiler.disable  # a collective: run as it is under --compile (a graph break), never traced
def scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""
    return _ScatterSequence.apply(x, group)


@torch.compiler.disable  # a collective: run as it is under --compile (a graph break), never traced
def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient backward. Enters a column-parallel region."""
    return _CopyToGroup.apply(x, group)


@torch.compiler.disable  # a collective: run as it is under --compile (a graph break), never traced
def reduce_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward. Leaves a row-parallel region."""
    return _ReduceFromGroup.apply(x, group)


@torch.compiler.disable  # a collective: run as it is under --compile (a graph break), never traced
def gather_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""
    return _GatherFromGroup.apply(x, group)


@torch.compiler.disable  # a collective: run as it is under --compile (a graph break), never traced
def split_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""
    return _SplitToGroup.apply(x, group)


def _check_divisible(width: int, n: int, what: str, name: str) -> None:
    if width % n:
        raise ConfigError(f"tensor parallel: layer {name} has {width} {what}, not divisible by `tp` {n}; "
                          f"choose a `tp` that divides it or widths that `tp` divides")


class ColumnParallelLinear(nn.Module):
    """This rank's ``out/t`` output features of ``linear``; ``gather_output`` all-gathers the full ``y``.

    Built from a full ``nn.Linear`` (its rows sliced: the same function as the whole layer) or,
    with :meth:`from_shard`, from this rank's ``(out/t, in)`` weight and ``(out/t,)`` bias alone.
    """

    tp_split = {"weight": 0, "bias": 0}  # parameter -> the dimension its shards split (snapshots reshard by it)

    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = True, name: str = "linear"):
        n, r = group_size(group), group_rank(group)
        _check_divisible(linear.out_features, n, "output features", name)
        bias = linear.bias.detach().chunk(n)[r] if linear.bias is not None else None
        self._setup(linear.weight.detach().chunk(n, dim=0)[r], bias, group, gather_output, linear.in_features,
                    linear.out_features)

    @classmethod
    def from_shard(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None,
                   gather_output: bool = True) -> "ColumnParallelLinear":
        """A layer whose full weight is ``(t * weight.shape[0], weight.shape[1])``; this rank holds ``weight``."""
        layer = cls.__new__(cls)
        layer._setup(weight.detach(), None if bias is None else bias.detach(), group, gather_output,
                     weight.shape[1], weight.shape[0] * group_size(group))
        return layer

    def _setup(self, weight, bias, group, gather_output, in_features, out_features) -> None:
        nn.Module.__init__(self)
        self.group, self.gather_output = group, gather_output
        self.copy_input = True  # False: the caller entered the parallel region already (one all-reduce for several)
        self.sequence_parallel = False  # True: the input is split along the sequence; all-gather it first
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None

    def full_parameters(self) -> list[torch.Tensor]:
        """The unsharded weight (and bias), gathered from the group (collective)."""
        full = [all_gather_along(self.weight.detach(), self.group, 0)]
        return full + ([all_gather_along(self.bias.detach(), self.group, 0)] if self.bias is not None else [])

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_sequence(x, self.group)
        elif self.copy_input:
            x = copy_to_group(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_group(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """This rank's ``in/t`` input features of ``linear``; the partial outputs are all-reduced and
    the (replicated) bias added once. ``input_is_parallel``: ``x`` is already this rank's slice."""

    tp_split = {"weight": 1}  # the bias is replicated

    def __init__(self, linear: nn.Linear, group=None, input_is_parallel: bool = True, name: str = "linear"):
        n, r = group_size(group), group_rank(group)
        _check_divisible(linear.in_features, n, "input features", name)
        bias = linear.bias.detach() if linear.bias is not None else None
        self._setup(linear.weight.detach().chunk(n, dim=1)[r], bias, group, input_is_parallel, linear.in_features,
                    linear.out_features)

    @classmethod
    def from_shard(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None,
                   input_is_parallel: bool = True) -> "RowParallelLinear":
        """A layer whose full weight is ``(weight.shape[0], t * weight.shape[1])``; this rank holds
        ``weight`` and the whole (replicated) ``bias``."""
        layer = cls.__new__(cls)
        layer._setup(weight.detach(), None if bias is None else bias.detach(), group, input_is_parallel,
                     weight.shape[1] * group_size(group), weight.shape[0])
        return layer

    def _setup(self, weight, bias, group, input_is_parallel, in_features, out_features) -> None:
        nn.Module.__init__(self)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = False  # True: reduce-scatter the output along the sequence instead of all-reducing
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None

    def full_parameters(self) -> list[torch.Tensor]:
        """The unsharded weight (and the replicated bias), gathered from the group (collective)."""
        full = [all_gather_along(self.weight.detach(), self.group, 1)]
        return full + ([self.bias.detach().clone()] if self.bias is not None else [])

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_to_group(x, self.group)
        y = F.linear(x, self.weight)
        y = scatter_sequence(y, self.group) if self.sequence_parallel else reduce_from_group(y, self.group)
        return y + self.bias if self.bias is not None else y
