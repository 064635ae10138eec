"""How a model describes itself to the parallel strategies: plain data, no distribution.

A model may define any of these methods; each strategy that needs one asks for it and refuses,
naming the method, where a model has none:

``checkpoint_blocks()``
    ``[(container, [(start, end), ...])]``: ranges of an ``nn.Sequential``'s children that
    activation checkpointing recomputes as one block (:func:`groups_ending_after`,
    :func:`groups_starting_at` cut them). A plain ``nn.Sequential`` checkpoints each child.
``pipeline_layers()``
    ``[(name, module), ...]``: the layers in order, what a pipeline cuts into stages.
``tensor_parallel_plan(tp, style, sequence_parallel)``
    ``{module name: STYLE}`` in the order to apply them (below); the model checks its own limits
    (say, heads that ``tp`` does not divide) and raises :class:`~distlab.errors.ConfigError`.

The tensor-parallel styles (``distlab.parallel.tp_plan`` applies them, to any model):

==========================  =====================================================================
``colwise``                 an ``nn.Linear`` split by output features; the output stays split
``colwise_gather``          the same, its output all-gathered (the naive style: every layer alone)
``colwise_entered``         ``colwise`` after an ``enter`` (its input's gradient is reduced there)
``rowwise``                 an ``nn.Linear`` split by input features; the outputs are summed
``enter``                   an ``nn.Identity`` where one parallel region begins: the gradient of
                            its input is all-reduced (one reduction for several ``colwise_entered``)
``vocab_embedding``         an ``nn.Embedding`` split by rows (tokens); lookups summed
``vocab_output``            an ``nn.Linear`` to vocabulary logits, split by output features; the
                            logits stay split and the loss is computed across them
``sequence``                (sequence parallel) a module between the parallel regions that sees
                            ``T / tp`` positions: its parameters' gradients are summed over the group
``sequence_stats``          (sequence parallel) a ``sequence`` module that also computes statistics
                            of whole sequences (a mixture of experts' routing counts): it gets the
                            group as its ``sequence_group`` and ``sequence_grad = "sum"``
``sequence_embedding``      (sequence parallel) a module with token and position embeddings ``tok``
                            and ``pos`` (``tok`` a ``vocab_embedding``) that returns this rank's
                            positions: ``tok(idx)`` reduce-scattered plus its rows of ``pos``
==========================  =====================================================================

Under sequence parallel ``enter`` gathers the sequence, ``rowwise`` reduce-scatters it (and its
bias sees this rank's positions), and ``colwise`` gathers its input's sequence.
"""

from __future__ import annotations

from torch import nn

PLAN_STYLES = ("colwise", "colwise_gather", "colwise_entered", "rowwise", "enter", "vocab_embedding", "vocab_output",
          "sequence", "sequence_stats", "sequence_embedding")


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


def linear_plan(container: nn.Sequential, prefix: str, style: str, keep_last: bool = True) -> dict[str, str]:
    """The plan of the ``nn.Linear`` layers of ``container`` (named ``prefix.i``), with only
    element-wise layers between them. Megatron: consecutive Linears pair up as (``colwise``,
    ``rowwise``): one all-reduce per pair forward; naive: each Linear ``colwise_gather``. With
    ``keep_last`` the last Linear that is left over -- a classifier head -- stays whole."""
    linears = [i for i, m in enumerate(container) if isinstance(m, nn.Linear)]
    name = (lambda i: f"{prefix}.{i}") if prefix else str
    if style == "megatron":
        pairs = list(zip(linears[0::2], linears[1::2]))
        return {k: v for a, b in pairs for k, v in ((name(a), "colwise"), (name(b), "rowwise"))}
    return {name(i): "colwise_gather" for i in (linears[:-1] if keep_last else linears)}
