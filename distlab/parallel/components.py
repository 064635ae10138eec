"""The model-sharding components a strategy can name: one registry, in the order they are applied.

A component is a parallelism that splits the model or its batch beside the gradient sync and the
step schedule -- context parallel (each sequence's tokens), expert parallel (the experts), tensor
parallel (the layers), or one of your own. Its *kind* is a subclass of
:class:`~distlab.parallel.protocols.ComponentKind` (``name``, ``dim``, ``wanted``, ``check``, ``apply``,
``price``, ``describe``, ``report``: the defaults are the no-ops, and a ``price`` that refuses to plan
what it does not know); ``apply`` returns the :class:`~distlab.parallel.protocols.ModelSharding`
component the Engine calls at every step (``prepare_batch``, ``reduce_gradients``, ``lockstep``).

:func:`~distlab.parallel.parallelize` applies every wanted kind in registry order -- after the
pipeline's cut is chosen on the unsharded model, before the cut and the gradient sync -- and hands
the components to the Engine in that order. Nothing in the Engine, the Trainer, evaluation or the
planner names one.

**Adding a parallelism** is its own file and one line: the class's ``module:Class`` in
:data:`BUILT_IN`, or, without touching distlab, ``NAME=module:Class`` in the ``DISTLAB_COMPONENTS``
environment variable (comma-separated; :func:`register` adds to it, so worker processes started
afterwards see it too). A strategy then names it (``bucketed+NAME``; ``bucketed+NAME=N`` for a kind that owns a
mesh dimension, ``dim = name``, which the mesh then makes), ``verify`` runs it against one
process, and a settings file can name it but never load code: only the environment and this file
say where a kind lives.
"""

from __future__ import annotations

import importlib
import os

BUILT_IN = (
    "distlab.parallel.context_parallel:ContextParallel",  # cp=N: each sequence's tokens over N ranks
    "distlab.parallel.expert_parallel:ExpertParallel",    # ep=N: the experts over N data-parallel ranks
    "distlab.parallel.tensor_parallel.plan:TensorParallel",            # tp=N (+sp): the layers over N ranks
)
ENV = "DISTLAB_COMPONENTS"


def registered() -> dict[str, str]:
    """Each component named in ``DISTLAB_COMPONENTS`` -> where its kind lives (``module:Class``)."""
    out = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV, "").split(","))):
        name, eq, where = entry.partition("=")
        if not eq or ":" not in where:
            from distlab.errors import ConfigError
            raise ConfigError(f"{ENV}: {entry!r} is not NAME=module:Class")
        out[name.strip()] = where.strip()
    return out


def names() -> tuple[str, ...]:
    """The names a strategy may list in ``components`` (those registered beside the built-ins)."""
    return tuple(registered())


def register(name: str, where: str) -> None:
    """Register the kind at ``where`` (``module:Class``) under ``name``, for this process and the
    worker processes it starts from now on (through ``DISTLAB_COMPONENTS``)."""
    entries = {**registered(), name: where}
    os.environ[ENV] = ",".join(f"{n}={w}" for n, w in entries.items())


def load(where: str) -> type:
    """The :class:`~distlab.parallel.protocols.ComponentKind` at ``module:Class``."""
    from distlab.errors import ConfigError
    from distlab.parallel.protocols import ComponentKind
    module, _, attr = where.partition(":")
    try:
        kind = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"component {where}: {e} (check {ENV} or distlab.parallel.components.BUILT_IN)") from None
    if not (isinstance(kind, type) and issubclass(kind, ComponentKind)):
        raise ConfigError(f"component {where} is not a component kind: subclass "
                          f"distlab.parallel.protocols.ComponentKind (name, apply; check, price, describe as it has them)")
    return kind


def kinds() -> list[type]:
    """Every component kind, built-in first, in the order they are applied."""
    return [load(w) for w in (*BUILT_IN, *registered().values())]


def wanted(strategy) -> list[type]:
    """The kinds ``strategy`` turns on, in the order they are applied."""
    return [kind for kind in kinds() if kind.wanted(strategy)]
