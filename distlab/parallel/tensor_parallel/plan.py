"""Apply a model's tensor-parallel plan: any model, any plan, no model named here.

A model says which of its modules are split and how (``tensor_parallel_plan(tp, style,
sequence_parallel)`` -> ``{module name: style}``; the styles are listed in
:mod:`distlab.models.plans`); :func:`apply_tensor_parallel` swaps each named module for its
parallel version over the group, in the plan's order, slicing the full, seeded module so the
sharded model computes what the whole one does. A plain ``nn.Sequential`` without a plan gets
the default one (:func:`~distlab.models.plans.linear_plan` of its Linear layers); any other model
without one is refused, naming the method it must provide.
"""

from __future__ import annotations

from torch import nn

from distlab.errors import ConfigError, with_article
from distlab.models import plans
from distlab.models.plans import linear_plan
from distlab.parallel.cost import Call, CallGroup, Price
from distlab.parallel.tensor_parallel.layers import STYLES, ColumnParallelLinear, RowParallelLinear
from distlab.parallel.tensor_parallel.mappings import all_reduce_sum
from distlab.parallel.protocols import ComponentKind
from distlab.parallel.tensor_parallel.vocabulary import (CopyToGroup, GatherSequence, SequenceParallelEmbedding,
                                                         VocabParallelEmbedding, VocabParallelLinear)
from distlab.runtime import group_size


def plan_of(model: nn.Module, tp: int, style: str = "megatron", sequence_parallel: bool = False) -> dict[str, str]:
    """``model``'s tensor-parallel plan for ``tp`` ranks (its own, or a plain ``nn.Sequential``'s default:
    :func:`distlab.models.plans.plan_of`), checked for what sequence parallel needs."""
    if style not in STYLES:
        raise ConfigError(f"unknown `tp_style` {style!r}; choose one of: {', '.join(STYLES)}")
    default = (lambda m: linear_plan(m, "", style)) if isinstance(model, nn.Sequential) else None
    plan = plans.plan_of(model, "tensor", default, tp=tp, style=style, sequence_parallel=sequence_parallel)
    if sequence_parallel and not any(s in ("sequence", "sequence_stats", "sequence_embedding") for s in plan.values()):
        raise ConfigError(f"`sequence_parallel` splits a transformer's sequence: {type(model).__name__}'s "
                          f"tensor-parallel plan declares no sequence-parallel regions")
    if sequence_parallel and "colwise_gather" in plan.values():
        raise ConfigError("sequence parallel needs the megatron `tp_style` (column then row parallel)")
    return plan


class TensorParallel(ComponentKind):
    """The component kind (:mod:`distlab.parallel.components`): ``tp=N`` (``+sp``) splits the layers the
    model's plan names over the mesh's tensor-parallel group. The split layers communicate inside their
    own forward and backward (and sequence-parallel regions sum their gradients as they are computed),
    so the component itself leaves the batch and the gradients as they are."""

    name = dim = "tp"
    lockstep = False  # tensor-parallel ranks exchange data in their own group, never across replicas

    @staticmethod
    def check(model: nn.Module, strategy, input_shape: tuple[int, ...]) -> None:
        """Before launch, on the model built on the meta device: it declares a plan for this layout (and
        its own limits hold: the model raises, naming them)."""
        plan_of(model, strategy.tp, strategy.tp_style, strategy.sequence_parallel)

    @classmethod
    def apply(cls, model: nn.Module, strategy, mesh) -> tuple[nn.Module, "TensorParallel"]:
        return apply_tensor_parallel(model, mesh.tp_group, strategy.tp_style, strategy.sequence_parallel), cls()

    @staticmethod
    def price(t, t_rank, lay, micro: int, optim) -> Price:
        """Megatron MLP blocks, on the model's trace: per (column, row) pair of Linears one all-reduce of
        the block's output in forward and one of its input gradient in backward, over a node's links
        where the data-parallel size is 1; the model state split ``tp`` ways (not exactly: replicated
        LayerNorms and biases)."""
        if len(t.linear_shapes) < 2:
            raise ConfigError(f"`tp` {lay.tp}: distlab's tensor parallel shards pairs of Linear layers (MLPs); this "
                              f"model has {len(t.linear_shapes)} Linear layer(s): plan it with `tp` 1")
        e, calls = t.element_size, []
        for (d_in, _), (_, d_out) in zip(t.linear_shapes[0::2], t.linear_shapes[1::2]):
            calls += [Call("native", "all_reduce", micro * d_out * e), Call("native", "all_reduce", micro * d_in * e)]
        note = (", split over the tensor-parallel ranks" if lay.strategy.sequence_parallel else
                ", split over the tensor-parallel ranks except in LayerNorm and embedding regions (replicated "
                "without sequence parallel)")
        return Price([CallGroup(calls * lay.strategy.grad_accum, lay.tp, local=lay.dp > 1)], exact=False,
                     state_split=lay.tp, compute_split=lay.tp, activation_note=note)

    @staticmethod
    def describe(engine) -> list[str]:
        """The layers split on this rank (whole-model names) and their share of its parameters."""
        module = engine.module
        layers = [(name, m) for name, m in module.named_modules()
                  if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))]
        names = [engine.schedule.model_key(n) for n, _ in layers]
        split = sum(p.numel() for _, m in layers for p in m.parameters())
        total = sum(p.numel() for p in module.parameters())
        return [f"tensor parallel: {len(names)} layers split ({', '.join(names) or 'none'}), {split:,} of this "
                f"rank's {total:,} parameters; the rest is replicated"]

    def prepare_batch(self, *tensors):
        return tensors

    def reduce_gradients(self) -> None:
        pass


def apply_tensor_parallel(model: nn.Module, group=None, style: str = "megatron",
                          sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` over ``group`` as its plan says, in place; returns it. ``sequence_parallel``
    also splits the regions between the parallel blocks along the sequence (the plan's ``sequence``
    modules; their parameters' gradients are then summed over the group as they are computed)."""
    plan = plan_of(model, group_size(group), style, sequence_parallel)
    shared: list[nn.Parameter] = []  # parameters that see this rank's positions only
    for name, kind in plan.items():
        module = model.get_submodule(name)
        new = _parallel(module, kind, group, name, sequence_parallel, shared)
        if new is not module:
            _replace(model, name, new)
    for p in dict.fromkeys(shared):  # once each, in order
        p.register_hook(lambda g: all_reduce_sum(g.contiguous().clone(), group))
    return model


def _parallel(m: nn.Module, kind: str, group, name: str, sp: bool, shared: list) -> nn.Module:
    """The parallel version of ``m`` for plan style ``kind`` (or ``m`` itself, changed in place)."""
    if kind in ("colwise", "colwise_gather", "colwise_entered", "rowwise", "vocab_output"):
        _expect(m, nn.Linear, kind, name)
    if kind in ("colwise", "colwise_gather", "colwise_entered"):
        layer = ColumnParallelLinear(m, group, gather_output=kind == "colwise_gather", name=name)
        layer.copy_input = kind != "colwise_entered"
        layer.sequence_parallel = sp and kind == "colwise"
        return layer
    if kind == "rowwise":
        layer = RowParallelLinear(m, group, input_is_parallel=True, name=name)
        layer.sequence_parallel = sp
        if sp and layer.bias is not None:
            shared.append(layer.bias)
        return layer
    if kind == "vocab_output":
        return VocabParallelLinear(m, group, name=name)
    if kind == "enter":
        _expect(m, nn.Identity, kind, name)
        return GatherSequence(group) if sp else CopyToGroup(group)
    if kind == "vocab_embedding":
        _expect(m, nn.Embedding, kind, name)
        return VocabParallelEmbedding(m, group, name=name)
    if kind in ("sequence", "sequence_stats"):
        if sp:
            shared.extend(m.parameters())
            if kind == "sequence_stats":
                if not hasattr(m, "sequence_group"):
                    raise ConfigError(f"tensor-parallel plan: {name} ({type(m).__name__}) is sequence_stats but has "
                                      f"no `sequence_group` attribute to complete its statistics over")
                m.sequence_group, m.sequence_grad = group, "sum"
        return m
    # sequence_embedding
    if not sp:
        return m
    if not (isinstance(getattr(m, "tok", None), VocabParallelEmbedding) and isinstance(getattr(m, "pos", None),
                                                                                       nn.Embedding)):
        raise ConfigError(f"tensor-parallel plan: {name} is a sequence_embedding but has no vocabulary-parallel `tok` "
                          f"and `pos` embeddings (list {name}.tok as a vocab_embedding before it)")
    embedding = SequenceParallelEmbedding(m, group)
    shared.append(embedding.pos.weight)
    return embedding


def _expect(m: nn.Module, kind: type, style: str, name: str) -> None:
    if type(m) is not kind:
        raise ConfigError(f"tensor-parallel plan: {name} is {with_article(type(m).__name__)}, but style {style} applies to an "
                          f"nn.{kind.__name__}")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
