"""Column- and row-parallel linear layers: slices of a full ``nn.Linear`` over a tensor-parallel
group (:mod:`distlab.parallel.tensor_parallel` says how they split and what they send)."""


from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError
from distlab.parallel.protocols import LowRankAdapted, split_shape, value_copy
from distlab.parallel.tensor_parallel.mappings import (all_gather_along, copy_to_group, gather_from_group,
                                                       gather_sequence, reduce_from_group, scatter_sequence,
                                                       split_to_group)
from distlab.runtime import group_rank, group_size

STYLES = ("megatron", "naive")


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
        frozen_as(self, linear)

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
        self.adapter = None  # a low-rank update's arithmetic, where :func:`adapt` gave the layer one

    def full_shape(self, name: str) -> tuple[int, ...]:
        return split_shape(self, name)

    def full_parameters(self) -> list[torch.Tensor]:
        """The unsharded weight (and bias, and adapter), gathered from the group (collective)."""
        full = [all_gather_along(value_copy(self.weight), self.group, 0)]  # (a 4-bit part: dequantized)
        full += [all_gather_along(self.bias.detach(), self.group, 0)] if self.bias is not None else []
        if self.adapter is not None:  # A whole on every rank, B's rows split with the weight's
            full += [self.lora_a.detach().clone(), all_gather_along(self.lora_b.detach(), self.group, 0)]
        return full

    def forward(self, x):
        if self.sequence_parallel:
            x = gather_sequence(x, self.group)
        elif self.copy_input:
            x = copy_to_group(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.adapter is not None:
            y = self.adapter(y, x, self.lora_a, self.lora_b, self.training)
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
        frozen_as(self, linear)

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
        self.adapter = None

    def full_shape(self, name: str) -> tuple[int, ...]:
        return split_shape(self, name)

    def full_parameters(self) -> list[torch.Tensor]:
        """The unsharded weight (the replicated bias, the adapter), gathered from the group (collective)."""
        full = [all_gather_along(value_copy(self.weight), self.group, 1)]
        full += [self.bias.detach().clone()] if self.bias is not None else []
        if self.adapter is not None:  # A's columns split with the weight's, B whole on every rank
            full += [all_gather_along(self.lora_a.detach(), self.group, 1), self.lora_b.detach().clone()]
        return full

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_to_group(x, self.group)
        y = F.linear(x, self.weight)
        if self.adapter is not None:  # this rank's part of the update, summed with the weight's
            y = self.adapter(y, x, self.lora_a, self.lora_b, self.training)
        y = scatter_sequence(y, self.group) if self.sequence_parallel else reduce_from_group(y, self.group)
        return y + self.bias if self.bias is not None else y


def frozen_as(layer: nn.Module, source: nn.Module) -> None:
    """``layer``'s weight and bias need a gradient where ``source``'s did (a frozen base stays frozen)."""
    for name in ("weight", "bias"):
        mine, theirs = getattr(layer, name), getattr(source, name)
        if mine is not None and theirs is not None:
            mine.requires_grad_(theirs.requires_grad)


def adapt(layer: ColumnParallelLinear | RowParallelLinear, source: nn.Module, shared: list) -> None:
    """Give ``layer`` the low-rank adapter of ``source`` (a :class:`~distlab.parallel.protocols.LowRankAdapted`
    layer; any other module: nothing), split as the layer splits its weight: a column-parallel layer's ``B`` by rows
    (its output features), a row-parallel layer's ``A`` by columns (its input features). The other factor is
    whole on every rank and sees only this rank's part of the gradient: it joins ``shared`` (summed over
    the group). The frozen weight stays frozen."""
    if not isinstance(source, LowRankAdapted):
        return
    n, r = group_size(layer.group), group_rank(layer.group)
    column = isinstance(layer, ColumnParallelLinear)
    a, b = source.lora_a.detach(), source.lora_b.detach()
    layer.lora_a = nn.Parameter(a.clone() if column else a.chunk(n, dim=1)[r].clone())
    layer.lora_b = nn.Parameter(b.chunk(n, dim=0)[r].clone() if column else b.clone())
    layer.adapter = source.adapter
    layer.tp_split = {**type(layer).tp_split, **({"lora_b": 0} if column else {"lora_a": 1})}
    shared.append(layer.lora_a if column else layer.lora_b)
