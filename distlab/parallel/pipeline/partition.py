"""A model as a sequence of layers (:func:`sequential_layers`) and where a pipeline cuts it
(:func:`partition`: contiguous stages balanced by parameter count, or at the layer counts given)."""

from __future__ import annotations

from torch import nn

from distlab.errors import ConfigError
from distlab.models.contract import contract


def sequential_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(name, layer), ...]``: the model as layers applied one after another, each under its
    name in ``model`` (so a stage's state-dict keys can be written as the whole model's): its
    ``pipeline_layers()`` (:class:`~distlab.models.contract.ModelContract`: an ``nn.Sequential``'s children)."""
    return list(contract(model).pipeline_layers())


def partition(model: nn.Module, stages: int, balance: list[int] | None = None) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the layer range of each stage (indices into :func:`sequential_layers`).

    ``balance`` gives the number of layers per stage. Otherwise stage ``k`` starts at the layer
    with parameters where the parameters before it come nearest ``k / stages`` of the total; layers
    without parameters (activations, pooling, flatten) stay with the layer before them, so every
    stage has parameters to train whenever the model has at least ``stages`` layers with some.
    """
    return cut([sum(p.numel() for p in layer.parameters()) for _, layer in sequential_layers(model)], stages, balance)


def cut(sizes: list[int], stages: int, balance: list[int] | None = None) -> list[tuple[int, int]]:
    """:func:`partition` on the layers' parameter counts alone (what ``distlab plan`` cuts by)."""
    n = len(sizes)
    if stages < 1 or stages > n:
        raise ConfigError(f"`pp` {stages}: the model has {n} layers to cut into stages; use between 1 and {n} "
                          f"stages")
    if balance is not None:
        if len(balance) != stages or sum(balance) != n or min(balance) < 1:
            raise ConfigError(f"pipeline: balance {list(balance)} must give {stages} positive layer counts summing "
                              f"to {n}")
        bounds = [0]
        for b in balance:
            bounds.append(bounds[-1] + b)
        ranges = list(zip(bounds[:-1], bounds[1:]))
        empty = [s for s, (a, b) in enumerate(ranges) if not sum(sizes[a:b])]
        if empty and sum(sizes):
            raise ConfigError(f"pipeline: balance {list(balance)} leaves stage {empty[0]} without parameters; give "
                              f"every stage a layer with parameters")
        return ranges
    if not sum(sizes):  # nothing to balance: layers count equally
        sizes = [1] * n
    heavy = [i for i, size in enumerate(sizes) if size]  # the layers a stage may start at (and the first)
    if stages > len(heavy):
        raise ConfigError(f"`pp` {stages}: the model has {len(heavy)} layers with parameters, and a stage without "
                          f"any would have nothing to train; use at most {len(heavy)} stages")
    before = [0]  # parameters before each heavy layer
    for i in heavy[:-1]:
        before.append(before[-1] + sizes[i])
    total, starts = sum(sizes), [0]
    for k in range(1, stages):
        low, high = starts[-1] + 1, len(heavy) - (stages - k)  # leave a heavy layer for every later stage
        starts.append(min(range(low, high + 1), key=lambda j: abs(before[j] - k * total / stages)))
    cuts = [0] + [heavy[j] for j in starts[1:]] + [n]
    return list(zip(cuts[:-1], cuts[1:]))
