"""Tensor parallel's plan styles, one small class each: what it makes of the module a plan names
(``apply``) and the collectives it issues per micro-batch (``calls``), so the planner prices the
model's own plan the way it runs (torchtitan's ``ColwiseParallel``/``RowwiseParallel`` are the model).

A style's ``calls(io, micro, sp)`` reads the module's :class:`~distlab.parallel.cost.ModuleIO` (its
input and output per sample, whether its input needs a gradient, its parameters), ``micro`` samples
per micro-batch and whether the sequence is split (``sp``); sizes are the whole tensors (the volume a
collective moves over the group is the machine model's: :func:`distlab.plan.machine.sent`).
"""

from __future__ import annotations

from torch import nn

from distlab.errors import ConfigError, with_article
from distlab.models.contract import SequenceStatistics, SplitEmbedding, contract
from distlab.parallel.cost import Call, ModuleIO
from distlab.parallel.protocols import LowRankAdapted
from distlab.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, adapt
from distlab.parallel.tensor_parallel.vocabulary import (CopyToGroup, GatherSequence, VocabParallelEmbedding,
                                                         VocabParallelLinear)

CE_REDUCTIONS = 3  # the vocabulary-parallel cross-entropy's all-reduces per token: max, sum of exponentials, target
SMOOTHING_REDUCTIONS = 1  # label smoothing's: the sum of the logits


def _ar(nbytes: float) -> Call:
    return Call("native", "all_reduce", nbytes)


def _ag(nbytes: float) -> Call:
    return Call("native", "all_gather", nbytes)


def _rs(nbytes: float) -> Call:
    return Call("native", "reduce_scatter", nbytes)


def _entering(nbytes: float, sp: bool, needs_grad: bool = True) -> list[Call]:
    """A parallel region's entry: its input's gradient all-reduced backward; under sequence parallel the
    sequence all-gathered forward and the gradient reduce-scattered backward."""
    if sp:
        return [_ag(nbytes)] + ([_rs(nbytes)] if needs_grad else [])
    return [_ar(nbytes)] if needs_grad else []


def _params(io: ModuleIO, *names: str) -> list[Call]:
    """Each parameter's gradient summed over the group as it is computed (a module that sees this rank's
    positions only): every one that gets a gradient, or those ``names`` (a frozen one gets none)."""
    return [_ar(n * io.element_size) for name, n in io.grads if not names or name in names]


def _adapter(io: ModuleIO, factor: str) -> list[Call]:
    """A low-rank adapter's factor kept whole on every rank (``lora_a`` of a column-parallel layer,
    ``lora_b`` of a row-parallel one): its gradient summed over the group."""
    return _params(io, factor)


def _expect(m: nn.Module, kind: type, style: str, name: str) -> None:
    adapted = kind is nn.Linear and isinstance(m, nn.Linear) and isinstance(m, LowRankAdapted)  # with an adapter
    if type(m) is not kind and not adapted:
        raise ConfigError(f"tensor-parallel plan: {name} is {with_article(type(m).__name__)}, but style {style} applies to an "
                          f"nn.{kind.__name__}")


def _column(m: nn.Module, group, name: str, style: str, gather: bool, enters: bool, sp: bool,
            shared: list) -> ColumnParallelLinear:
    """``m`` split by output features: its output gathered or not, its input entering the region here
    (the input's gradient reduced) or at an ``enter`` before it, gathered along the sequence or not."""
    _expect(m, nn.Linear, style, name)
    layer = ColumnParallelLinear(m, group, gather_output=gather, name=name)
    layer.copy_input, layer.sequence_parallel = enters, sp
    adapt(layer, m, shared)
    return layer


class Style:
    """A plan style: ``apply(m, group, name, sp, shared)`` returns the module's parallel version (or the
    module, changed in place), adding to ``shared`` the parameters whose gradients the group must sum;
    ``calls(io, micro, sp)`` the collectives of one micro-batch; ``splits`` the parameters it shards
    (the layer's ``tp_split``: the rest stay whole on every rank)."""

    splits: frozenset[str] = frozenset()

    @staticmethod
    def apply(m: nn.Module, group, name: str, sp: bool, shared: list) -> nn.Module:
        return m

    @staticmethod
    def calls(io: ModuleIO, micro: int, sp: bool) -> list[Call]:
        return []

    @staticmethod
    def forward_calls(io: ModuleIO, micro: int, sp: bool) -> list[Call]:
        """The forward's part of :meth:`calls` (run again where activation checkpointing recomputes it)."""
        return []


class Colwise(Style):
    """An ``nn.Linear`` split by output features; the output stays split. Its input enters the region
    (gathered along the sequence under sequence parallel)."""

    splits = frozenset(("weight", "bias", "lora_b"))

    @staticmethod
    def apply(m, group, name, sp, shared):
        return _column(m, group, name, "colwise", gather=False, enters=True, sp=sp, shared=shared)

    @staticmethod
    def calls(io, micro, sp):
        return _entering(io.input_bytes * micro, sp, io.input_grad) + _adapter(io, "lora_a")

    @staticmethod
    def forward_calls(io, micro, sp):
        return [_ag(io.input_bytes * micro)] if sp else []


class ColwiseGather(Style):
    """The naive style: split by output features, the output all-gathered, the input's gradient
    all-reduced."""

    splits = frozenset(("weight", "bias", "lora_b"))

    @staticmethod
    def apply(m, group, name, sp, shared):
        return _column(m, group, name, "colwise_gather", gather=True, enters=True, sp=False, shared=shared)

    @staticmethod
    def calls(io, micro, sp):
        return [_ag(io.output_bytes * micro)] + _entering(io.input_bytes * micro, False, io.input_grad) + \
            _adapter(io, "lora_a")

    @staticmethod
    def forward_calls(io, micro, sp):
        return [_ag(io.output_bytes * micro)]


class ColwiseEntered(Style):
    """``colwise`` after an ``enter``: its input's gradient is reduced there, once for several."""

    splits = frozenset(("weight", "bias", "lora_b"))

    @staticmethod
    def apply(m, group, name, sp, shared):
        return _column(m, group, name, "colwise_entered", gather=False, enters=False, sp=False, shared=shared)

    @staticmethod
    def calls(io, micro, sp):
        return _adapter(io, "lora_a")


class Rowwise(Style):
    """An ``nn.Linear`` split by input features; the partial outputs summed (reduce-scattered along the
    sequence under sequence parallel, where its bias sees this rank's positions)."""

    splits = frozenset({"weight", "lora_a"})

    @staticmethod
    def apply(m, group, name, sp, shared):
        _expect(m, nn.Linear, "rowwise", name)
        layer = RowParallelLinear(m, group, input_is_parallel=True, name=name)
        layer.sequence_parallel = sp
        if sp and layer.bias is not None and layer.bias.requires_grad:
            shared.append(layer.bias)
        adapt(layer, m, shared)
        return layer

    @staticmethod
    def calls(io, micro, sp):
        out = io.output_bytes * micro
        if not sp:
            return [_ar(out)] + _adapter(io, "lora_b")
        return [_rs(out), _ag(out)] + _params(io, "bias") + _adapter(io, "lora_b")

    @staticmethod
    def forward_calls(io, micro, sp):
        return [_rs(io.output_bytes * micro) if sp else _ar(io.output_bytes * micro)]


class Enter(Style):
    """An ``nn.Identity`` where a parallel region begins."""

    @staticmethod
    def apply(m, group, name, sp, shared):
        _expect(m, nn.Identity, "enter", name)
        return GatherSequence(group) if sp else CopyToGroup(group)

    @staticmethod
    def calls(io, micro, sp):
        return _entering(io.input_bytes * micro, sp, io.input_grad)

    @staticmethod
    def forward_calls(io, micro, sp):
        return [_ag(io.input_bytes * micro)] if sp else []


class VocabEmbedding(Style):
    """An ``nn.Embedding`` split by rows (tokens); the lookups summed (under sequence parallel the
    ``sequence_embedding`` around it reduce-scatters them instead)."""

    splits = frozenset({"weight", "lora_a"})

    @staticmethod
    def apply(m, group, name, sp, shared):
        _expect(m, nn.Embedding, "vocab_embedding", name)
        return VocabParallelEmbedding(m, group, name=name)

    @staticmethod
    def calls(io, micro, sp):
        return [] if sp else [_ar(io.output_bytes * micro)]

    @staticmethod
    def forward_calls(io, micro, sp):
        return [] if sp else [_ar(io.output_bytes * micro)]


class VocabOutput(Style):
    """An ``nn.Linear`` to vocabulary logits split by output features (its input enters the region at an
    ``enter`` before it); the loss computed across them: per token, three all-reduces of one number
    (four with label smoothing, priced by the component)."""

    splits = frozenset(("weight", "bias", "lora_b"))

    @staticmethod
    def apply(m, group, name, sp, shared):
        _expect(m, nn.Linear, "vocab_output", name)
        return VocabParallelLinear(m, group, name=name)

    @staticmethod
    def calls(io, micro, sp):
        return [_ar(4 * io.output_rows * micro)] * CE_REDUCTIONS


class Sequence(Style):
    """(sequence parallel) a module between the regions that sees ``T / tp`` positions: its parameters'
    gradients summed over the group."""

    @staticmethod
    def apply(m, group, name, sp, shared):
        if sp:
            shared.extend(m.parameters())
        return m

    @staticmethod
    def calls(io, micro, sp):
        return _params(io) if sp else []


class SequenceStats(Sequence):
    """(sequence parallel) a ``sequence`` module that also computes statistics of whole sequences: it
    gets the group as its ``sequence_group``."""

    @staticmethod
    def apply(m, group, name, sp, shared):
        if sp:
            shared.extend(m.parameters())
            if not isinstance(m, SequenceStatistics):
                raise ConfigError(f"tensor-parallel plan: {name} ({type(m).__name__}) is sequence_stats but is no "
                                  f"SequenceStatistics (distlab.models.contract) to complete its statistics over the "
                                  f"group")
            m.sequence_group, m.sequence_grad = group, "sum"
        return m


class SequenceEmbedding(Style):
    """(sequence parallel) a family's embedding (:class:`~distlab.models.contract.SplitEmbedding`) whose token
    lookups are reduce-scattered (all-gathered back in backward): its own forward then places this rank's
    piece of the positions -- scale, position rows and all -- and its other parameters' gradients (a
    position table's) are summed over the group."""

    @staticmethod
    def apply(m, group, name, sp, shared):
        if not sp:
            return m
        from distlab.runtime import group_rank
        if not (isinstance(m, SplitEmbedding) and isinstance(m.get_submodule("tok"), VocabParallelEmbedding)):
            raise ConfigError(f"tensor-parallel plan: {name} is a sequence_embedding but is not a SplitEmbedding "
                              f"with a vocabulary-parallel `tok` embedding (list {name}.tok as a vocab_embedding "
                              f"before it; distlab.models.contract.SplitEmbedding)")
        m.tok.sequence_parallel, m.part = True, group_rank(group)
        shared.extend(p for key, p in m.named_parameters() if not key.startswith("tok."))
        return m

    @staticmethod
    def calls(io, micro, sp):
        if not sp:
            return []
        out = io.output_bytes * micro  # backward all-gathers the gradient -- where the embedding trains at all
        return [_rs(out)] + ([_ag(out)] if io.grads else []) + \
            [_ar(n * io.element_size) for name, n in io.grads if not name.startswith("tok.")]  # a position table's


    @staticmethod
    def forward_calls(io, micro, sp):
        return [_rs(io.output_bytes * micro)] if sp else []


class Replicated(Style):
    """A module kept whole on every rank, each rank using only part of its output (grouped-query attention's
    key/value projections where ``tp`` does not divide the key/value heads): each rank's gradient covers its
    part, so the parameters' gradients are summed over the group."""

    @staticmethod
    def apply(m, group, name, sp, shared):
        shared.extend(m.parameters())
        return m

    @staticmethod
    def calls(io, micro, sp):
        return _params(io)


class TensorRank(Style):
    """A module that takes its own share: told the group's rank and size (``m.tensor_rank(rank, size)``),
    e.g. an attention choosing the key/value heads its rank's query heads read."""

    @staticmethod
    def apply(m, group, name, sp, shared):
        from distlab.runtime import group_rank, group_size
        contract(m).tensor_rank(group_rank(group), group_size(group))
        return m


TP_STYLES: dict[str, type[Style]] = {
    "colwise": Colwise, "colwise_gather": ColwiseGather, "colwise_entered": ColwiseEntered, "rowwise": Rowwise,
    "enter": Enter, "vocab_embedding": VocabEmbedding, "vocab_output": VocabOutput, "sequence": Sequence,
    "sequence_stats": SequenceStats, "sequence_embedding": SequenceEmbedding, "replicated": Replicated,
    "tensor_rank": TensorRank,
}
