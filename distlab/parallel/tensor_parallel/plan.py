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

import dataclasses

from torch import nn

from distlab.errors import ConfigError
from distlab.models import plans
from distlab.parallel.cost import Call, CallGroup, Price, block_index, blocks_of, in_stage, under
from distlab.parallel.protocols import ComponentKind
from distlab.parallel.tensor_parallel.layers import STYLES, ColumnParallelLinear, RowParallelLinear
from distlab.parallel.tensor_parallel.mappings import all_reduce_sum
from distlab.parallel.tensor_parallel.styles import SMOOTHING_REDUCTIONS, TP_STYLES
from distlab.parallel.tensor_parallel.vocabulary import VocabParallelEmbedding
from distlab.runtime import group_size


def plan_of(model: nn.Module, tp: int, style: str = "megatron", sequence_parallel: bool = False) -> dict[str, str]:
    """``model``'s tensor-parallel plan for ``tp`` ranks (its own, or a plain ``nn.Sequential``'s default:
    :func:`distlab.models.plans.plan_of`), checked for what sequence parallel needs."""
    if style not in STYLES:
        raise ConfigError(f"unknown `tp_style` {style!r}; choose one of: {', '.join(STYLES)}")
    plan = plans.plan_of(model, "tensor", tp=tp, style=style, sequence_parallel=sequence_parallel)
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
        """From the model's own plan for the layout (traced with the model: ``t.tensor_plans``): each
        planned module's style issues its collectives per micro-batch (:mod:`.styles`), over a node's
        links where the data-parallel size is 1; label smoothing adds one all-reduce per token to the
        vocabulary-parallel loss. The model state is what the plan splits (``t.tensor_split``: the
        pipeline's stage cost divides those units, the replicated LayerNorms and biases stay whole) --
        exact where the plan was traced."""
        st = lay.strategy
        key = t.tensor_key(st, lay.tp)
        plan = t.tensor_plans.get(key)
        if plan is None:
            raise ConfigError(f"`tp` {lay.tp}: this model declares no tensor-parallel plan (tensor_parallel_plan) for "
                              f"{st.tp_style}"
                              f"{' with sequence parallel' if st.sequence_parallel else ''}; plan it with `tp` 1")
        calls, samples = [], micro / lay.cp  # context parallel: each rank holds 1/cp of every sequence
        entering = 0.0  # what enters a parallel region whole (gathered under sequence parallel), saved whole
        ops = st.activation_checkpointing and st.ac_policy == "ops"
        kept_by = {n: b for layer in t.layers for n, b in layer.ops_kept_by.items()} if ops else {}
        checkpointed = {n for block in st.checkpointed(t.blocks) for n in block}
        recomputed = _recomputed(plan, st.checkpointed(t.blocks)) if st.activation_checkpointing else set()
        experts = set(t.expert_names) if lay.ep > 1 else set()  # expert parallel holds 1/ep of them
        for name, style in plan.items():
            if not in_stage(name, t_rank, lay):
                continue
            io = t.module_io[name]
            if experts:  # (a sequence region's gradients summed over the group: this rank's experts only)
                io = dataclasses.replace(io, grads=tuple((p, n // lay.ep if f"{name}.{p}" in experts else n)
                                                         for p, n in io.grads))
            calls += TP_STYLES[style].calls(io, samples, st.sequence_parallel)
            if style != "colwise_gather" and name not in recomputed:  # (the region's entry: what sequence
                entering += sum(c.nbytes for c in TP_STYLES[style].forward_calls(io, samples, True)  # parallel
                                if c.kind == "all_gather")  # gathers there; without it, what every rank holds)
            if style == "rowwise" and kept_by and under(name, checkpointed):
                # checkpointed per op: its kept output is its partial
                entering += kept_by.get(name, 0.0) * samples  # sums over every position, whole on each rank
            if name in recomputed:  # checkpointing runs its forward again in backward
                calls += TP_STYLES[style].forward_calls(io, samples, st.sequence_parallel)
            if style == "vocab_output" and lay.label_smoothing:
                calls += [Call("native", "all_reduce", 4 * io.output_rows * samples)] * SMOOTHING_REDUCTIONS
        note = (", split over the tensor-parallel ranks" if st.sequence_parallel else
                ", split over the tensor-parallel ranks except in LayerNorm and embedding regions (replicated "
                "without sequence parallel)")
        if entering:
            note += ("; each parallel region's input (gathered under sequence parallel) saved whole by the layers "
                     "that read it")
        return Price([CallGroup(calls * st.micro_steps, lay.tp, local=lay.dp > 1, dim="tp")],
                     exact=key in t.tensor_split, compute_split=lay.tp,
                     activation_note=note, activation_extra=entering * (1 - 1 / lay.tp))

    @staticmethod
    def describe(engine) -> list[str]:
        """The layers split on this rank (whole-model names) and their share of its parameters."""
        module = engine.module
        layers = [(name, m) for name, m in module.named_modules()
                  if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))]
        names = [engine.schedule.model_key(n) for n, _ in layers]
        split = sum(p.numel() for p in {id(p): p for _, m in layers for p in m.parameters()}.values())  # a tied
        # matrix (the embedding that is the LM head) once, as module.parameters() counts it
        total = sum(p.numel() for p in module.parameters())
        return [f"tensor parallel: {len(names)} layers split ({', '.join(names) or 'none'}), {split:,} of this "
                f"rank's {total:,} parameters; the rest is replicated"]

    def prepare_batch(self, *tensors):
        return tensors

    def reduce_gradients(self) -> None:
        pass


def _recomputed(plan: dict[str, str], blocks: list[list[str]]) -> set[str]:
    """The planned modules activation checkpointing runs again: every one inside a checkpointed block but a
    block's last row-parallel layer -- the recomputation stops once it has remade what backward saved (torch's
    early stop), and that layer's output only joins the residual stream."""
    index = block_index(blocks)
    mine: list[list[str]] = [[] for _ in blocks]  # each block's planned modules, in the plan's order
    for name, style in plan.items():
        for b in blocks_of(name, index) if style != "tensor_rank" else ():  # (tensor_rank configures a module)
            mine[b].append(name)
    out = set()
    for names in mine:
        out.update(names[:-1] if names and plan[names[-1]] == "rowwise" else names)
    return out


def apply_tensor_parallel(model: nn.Module, group=None, style: str = "megatron",
                          sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` over ``group`` as its plan says, in place; returns it. ``sequence_parallel``
    also splits the regions between the parallel blocks along the sequence (the plan's ``sequence``
    modules; their parameters' gradients are then summed over the group as they are computed)."""
    plan = plan_of(model, group_size(group), style, sequence_parallel)
    ties = plans.tied_names(model)
    shared: list[nn.Parameter] = []  # parameters that see this rank's positions only
    for name, kind in plan.items():
        module = model.get_submodule(name)
        new = TP_STYLES[kind].apply(module, group, name, sequence_parallel, shared)
        if new is not module:
            _replace(model, name, new)
    for names in ties:  # a tied embedding and LM head: split by the same vocabulary rows, one parameter again
        first = model.get_parameter(names[0])
        for name in names[1:]:
            if model.get_parameter(name) is not first:
                if model.get_parameter(name).shape != first.shape:
                    raise ConfigError(f"{names[0]} and {name} are one parameter, and the tensor-parallel plan splits "
                                      f"them differently ({tuple(first.shape)} and "
                                      f"{tuple(model.get_parameter(name).shape)} on this rank)")
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, first)
    for p in (p for p in dict.fromkeys(shared) if p.requires_grad):  # once each, in order (a frozen one: none)
        p.register_hook(lambda g: all_reduce_sum(g.contiguous().clone(), group))
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
