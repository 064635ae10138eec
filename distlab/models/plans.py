"""How a model describes itself to the parallel strategies: plain data, no distribution.

Each is a member of :class:`~distlab.models.contract.ModelContract`, with a default; a model defines
those it has (a model of your own need not inherit the base: :func:`~distlab.models.contract.contract`
gives it the defaults for the rest), and each strategy that needs one refuses, naming the method, where
a model's is empty. A model checks its own limits in them (heads that ``tp``
does not divide, experts that ``ep`` does not, a context that ``2 cp`` does not) and raises
:class:`~distlab.errors.ConfigError` naming its numbers -- a run is refused before launch, because
the settings check calls them on the model built on the meta device.

``checkpoint_blocks()``
    ``[(container, [(start, end), ...])]``: ranges of an ``nn.Sequential``'s children that
    activation checkpointing recomputes as one block (:func:`groups_ending_after`,
    :func:`groups_starting_at` cut them). A plain ``nn.Sequential`` checkpoints each child.
``pipeline_layers()``
    ``[(name, module), ...]``: the layers in order, what a pipeline cuts into stages.
``tensor_parallel_plan(tp, style, sequence_parallel)``
    ``{module name: STYLE}`` (tensor styles below) in the order to apply them. A plain
    ``nn.Sequential`` has a default (:func:`linear_plan`).
``context_parallel_plan(cp, style, tp)``
    ``{module name: STYLE}`` (context styles below): its attention, and its positions.
``expert_parallel_plan(ep)``
    ``{module name: STYLE}`` (the expert style below): the modules holding its experts.
``snapshot_record()``
    ``{field: value}``: the sizes a snapshot of this model must agree on to be resumed (plain JSON
    values; the run adds the model's name, its arguments and its parameter count).
``flops_per_token()``
    Training FLOPs per token, forward and backward (a language model's; PaLM's count): what a run's
    tokens/s becomes MFU with (:func:`distlab.models.flops_per_token`).

A *language model* -- its forward maps ``(B, T)`` token ids to ``(B, T, vocab)`` logits and it has a
``block_size`` (its longest context) -- can also generate text (:mod:`distlab.models.generation`):
the samples a run prints every ``--sample-every`` steps and ``distlab generate``. The older
spellings ``context_parallel_plan()`` and ``expert_parallel_plan()`` without arguments are still
read (:func:`plan_of` passes only the arguments a method takes).

Every style of every plan, one table (each parallelism applies its own, to any model:
:mod:`distlab.parallel.tensor_parallel.plan`, :mod:`distlab.parallel.context_parallel`,
:mod:`distlab.parallel.expert_parallel`):

==========================  ========  ============================================================
style                       plan      what the parallelism does to the named module
==========================  ========  ============================================================
``colwise``                 tensor    an ``nn.Linear`` split by output features; the output stays split
``colwise_gather``          tensor    the same, its output all-gathered (the naive style: every layer alone)
``colwise_entered``         tensor    ``colwise`` after an ``enter`` (its input's gradient is reduced there)
``rowwise``                 tensor    an ``nn.Linear`` split by input features; the outputs are summed
``enter``                   tensor    an ``nn.Identity`` where one parallel region begins: the gradient of
                                      its input is all-reduced (one reduction for several ``colwise_entered``)
``vocab_embedding``         tensor    an ``nn.Embedding`` split by rows (tokens); lookups summed
``vocab_output``            tensor    an ``nn.Linear`` to vocabulary logits, split by output features; the
                                      logits stay split and the loss is computed across them
``sequence``                tensor    (sequence parallel) a module between the parallel regions that sees
                                      ``T / tp`` positions: its parameters' gradients are summed over the group
``sequence_stats``          tensor    (sequence parallel) a ``sequence`` module that also computes statistics
                                      of whole sequences (a mixture of experts' routing counts): it gets the
                                      group as its ``sequence_group`` and ``sequence_grad = "sum"``
``sequence_embedding``      tensor    (sequence parallel) a module with a token embedding ``tok`` (a
                                      ``vocab_embedding``) and maybe a position embedding ``pos`` that
                                      returns this rank's positions: ``tok(idx)`` reduce-scattered (plus
                                      its rows of ``pos``)
``replicated``              tensor    a module kept whole on every rank, each using part of its output (key/
                                      value projections with fewer heads than ``tp`` splits): its
                                      parameters' gradients are summed over the group
``tensor_rank``             tensor    a module that takes its own share: ``m.tensor_rank(rank, size)`` is
                                      called with the group's (an attention picking its key/value heads)
``context_positions``       context   a module called with positions ``0..t-1`` (an ``nn.Embedding`` of
                                      positions, a rotary table with ``reads_positions``): it is given
                                      this rank's global positions
``context_attention``       context   an attention core ``(q, k, v) -> out`` (``(B, H, T, d)``, causal):
                                      replaced by ring attention or Ulysses over the sequence's ranks
``context_sequence_stats``  context   a module with per-sequence statistics (``sequence_group``): it
                                      completes them over the sequence's ranks
``experts``                 expert    a module computing its experts from ``(tokens sorted by expert,
                                      counts)``, parameters stacked along a first dimension of size
                                      ``experts``: each rank keeps ``experts / ep`` of them
==========================  ========  ============================================================

Under sequence parallel ``enter`` gathers the sequence, ``rowwise`` reduce-scatters it (and its
bias sees this rank's positions), and ``colwise`` gathers its input's sequence.
"""

from __future__ import annotations

import inspect

from torch import nn

from distlab.errors import ConfigError
from distlab.models.contract import contract, declares

STYLES = {
    "tensor": ("colwise", "colwise_gather", "colwise_entered", "rowwise", "enter", "vocab_embedding", "vocab_output",
               "sequence", "sequence_stats", "sequence_embedding", "replicated", "tensor_rank"),
    "context": ("context_positions", "context_attention", "context_sequence_stats"),
    "expert": ("experts",),
}
PLAN_STYLES = STYLES["tensor"]  # the tensor-parallel styles (the name older code reads)
METHODS = {"tensor": "tensor_parallel_plan(tp, style, sequence_parallel)",
           "context": "context_parallel_plan(cp, style, tp)", "expert": "expert_parallel_plan(ep)"}


def plan_of(model: nn.Module, plan: str, **sizes) -> dict[str, str]:
    """``model``'s ``plan`` ("tensor", "context" or "expert") for ``sizes``, given in the order of the
    method's signature above (``tp, style, sequence_parallel`` for the tensor plan): what its
    ``<plan>_parallel_plan`` returns (:class:`~distlab.models.contract.ModelContract`: a plain
    ``nn.Sequential``'s Linear layers by default), called with as many of them as it takes; refused in
    one line, naming the method, where the plan is empty or names a style of another plan."""
    found = declared_plan(model, plan, **sizes)
    if not found:
        if plan == "tensor" and not declares(model, f"{plan}_parallel_plan") and isinstance(model, nn.Sequential):
            raise ConfigError(f"{type(model).__name__} declares no {plan}-parallel plan and the default one is empty: "
                              f"this layout needs a model with Linear layers to split (or a {METHODS[plan]} method)")
        what = f"{type(model).__name__}'s is empty" if declares(model, f"{plan}_parallel_plan") else \
            f"{type(model).__name__} has none"
        raise ConfigError(f"this layout needs the model's {plan}-parallel plan, which a model declares in a "
                          f"{METHODS[plan]} method; {what} (see distlab.models.plans)")
    unknown = sorted({s for s in found.values() if s not in STYLES[plan]})
    if unknown:
        raise ConfigError(f"{type(model).__name__}'s {plan}-parallel plan has unknown style(s) {', '.join(unknown)}; "
                          f"its styles: {', '.join(STYLES[plan])}")
    return found


def declared_plan(model: nn.Module, plan: str, **sizes) -> dict[str, str]:
    """What ``model``'s ``<plan>_parallel_plan`` returns for ``sizes`` (in its signature's order, as many as
    it takes), unchecked; ``{}`` where it has none (the planner's tracer asks for names)."""
    model = contract(model)
    declared = {"tensor": model.tensor_parallel_plan, "context": model.context_parallel_plan,
                "expert": model.expert_parallel_plan}[plan]
    params = inspect.signature(declared).parameters.values()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes = len(sizes) if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params) else \
        sum(p.kind in positional for p in params)
    return dict(declared(*list(sizes.values())[:takes]))


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules share (a tied embedding and LM head), in order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def with_tied(model: nn.Module, state: dict) -> dict:
    """``state`` with every name of a tied parameter that it gives under one of them only (a file keeps
    one copy: Hugging Face's checkpoints of tied models have no ``lm_head.weight``)."""
    out = dict(state)
    for group in tied_names(model):
        given = next((name for name in group if name in out), None)
        for name in group if given else ():
            out.setdefault(name, out[given])
    return out


def retie(model: nn.Module, groups: list[list[str]]) -> nn.Module:
    """Make each group of names (:func:`tied_names`, taken before) one parameter again -- after a
    ``load_state_dict(assign=True)``, which gives every name its own tensor."""
    for group in groups:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, first)
    return model


def assign_state(model: nn.Module, state: dict) -> nn.Module:
    """``model`` (built on the meta device) given the tensors of ``state``, its tied parameters one again."""
    ties = tied_names(model)
    model.load_state_dict(with_tied(model, state), assign=True)
    return retie(model, ties)


def groups_ending_after(container: nn.Sequential, kinds: tuple[type, ...]) -> list[tuple[int, int]]:
    """Ranges of ``container``'s children, each ending after a module of ``kinds`` (or at the end)."""
    out, start = [], 0
    for i, m in enumerate(container):
        if isinstance(m, kinds):
            out.append((start, i + 1))
            start = i + 1
    if start < len(container):
        out.append((start, len(container)))
    return out


def groups_starting_at(container: nn.Sequential, kinds: tuple[type, ...]) -> list[tuple[int, int]]:
    """Ranges of ``container``'s children, a new one at each module of ``kinds`` (but the first)."""
    starts = [0] + [i for i, m in enumerate(container) if i and isinstance(m, kinds)]
    return list(zip(starts, starts[1:] + [len(container)]))
