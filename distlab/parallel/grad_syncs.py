"""The gradient syncs, in one table: which one a strategy gets, the wrapper that trains with it and the cost
model that prices it. :func:`~distlab.parallel.parallelize` builds the chosen wrapper, a snapshot is read back
by the kind that wrote it, and ``distlab plan`` prices the same choice -- all from this table, so a new gradient
sync is one row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from distlab.parallel.cost import DataParallelCost
from distlab.parallel.data_parallel import DataParallel
from distlab.errors import ConfigError
from distlab.parallel.zero import Zero
from distlab.parallel.zero.cost import ZeroCost
from distlab.parallel.zero.plain import PlainZero


@dataclass(frozen=True)
class SyncKind:
    """One gradient sync: when a strategy wants it, what trains with it (a
    :class:`~distlab.parallel.protocols.GradSync` with ``from_strategy`` and ``reads``), what prices it (a
    :class:`~distlab.parallel.protocols.StateCost`)."""

    name: str
    wants: Callable[[object], bool]
    wrapper: type
    cost: type


def _unplanned(*args, **kwargs):
    raise ConfigError("`zero_impl` plain is not planned: plan the tuned ZeRO (drop `zero_impl`), which the plain "
                      "one equals in what it computes")


class PlainZeroCost:
    """The plain ZeRO is for reading and for checking the tuned one; the planner prices the tuned one."""

    planned_calls = planned_memory = planned_parts = planned_extra_state = staticmethod(_unplanned)


# first match wins: ZeRO where the strategy asks for a stage (the plain one where it asks for that), data
# parallel's methods otherwise
SYNC_KINDS: tuple[SyncKind, ...] = (
    SyncKind("plain zero", lambda strategy: strategy.zero > 0 and strategy.zero_impl != "tuned", PlainZero,
             PlainZeroCost),
    SyncKind("zero", lambda strategy: strategy.zero > 0, Zero, ZeroCost),
    SyncKind("data parallel", lambda strategy: True, DataParallel, DataParallelCost),
)


def sync_kind(strategy) -> SyncKind:
    """The gradient sync ``strategy`` trains with."""
    return next(kind for kind in SYNC_KINDS if kind.wants(strategy))


def reader_of(state: dict) -> type:
    """The wrapper whose ``sharded_state_dict`` ``state`` is (of any stage, method and group size)."""
    return next(kind.wrapper for kind in SYNC_KINDS if kind.wrapper.reads(state))
