"""Run state as a registry: every stateful piece of a run saves and loads itself under a name.

A snapshot's payload (one per rank) is :meth:`StateRegistry.state_dict`; a resume is
:meth:`StateRegistry.load_state_dict`. Adding a stateful feature means registering it where it is
built -- not editing a payload builder:

.. code-block:: python

    registry.register("scheduler", scheduler.state_dict, scheduler.load_state_dict)
    registry.register("rng", rng_state, set_rng_state, reshard="mine")

What a piece does when the snapshot was written under another layout (``reshard``):

==========  ==================================================================================
``same``    the same on every rank of every layout (a schedule, the run's history): old rank 0's
``mine``    this rank's own stream (RNG): old rank ``r mod n``'s
``all``     a sum over ranks (the loss window): ``load`` gets a list: every old rank's value, in
            rank order (this rank's alone, in a list, on the same layout)
``fresh``   belongs to one rank of one layout (compression memory): not loaded, starts afresh
``layout``  cut by placement (model shards, optimizer state): loaded by the reshard, not here
==========  ==================================================================================

Entries load in the order they were registered; a registry may hold another (the Engine's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

POLICIES = ("same", "mine", "all", "fresh", "layout")


@dataclass
class _Entry:
    save: Callable[[], Any]
    load: Callable[[Any], None] | None
    reshard: str
    optional: bool
    inner: "StateRegistry | None" = None


class StateRegistry:
    """Named pieces of state, saved and loaded in registration order."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, save: Callable[[], Any], load: Callable[[Any], None] | None = None, *,
                 reshard: str = "same", optional: bool = False) -> None:
        """Save ``name`` with ``save()`` and load it with ``load(value)`` (None: written for others to
        read, as a placement is). ``optional``: ``save()`` may return None (then nothing is written)
        and a payload without it loads."""
        if name in self._entries:
            raise ValueError(f"run state {name!r} is registered twice")
        if reshard not in POLICIES:
            raise ValueError(f"run state {name!r}: reshard {reshard!r} is not one of {', '.join(POLICIES)}")
        self._entries[name] = _Entry(save, load, reshard, optional)

    def register_stateful(self, name: str, obj, **options) -> None:
        """Register an object with ``state_dict()`` and ``load_state_dict(state)`` (torch's convention)."""
        self.register(name, obj.state_dict, obj.load_state_dict, **options)

    def register_registry(self, name: str, inner: "StateRegistry", **options) -> None:
        """Register another registry under ``name``: its entries follow their own reshard rules."""
        self.register(name, inner.state_dict, inner.load_state_dict, **options)
        self._entries[name].inner = inner

    def names(self) -> list[str]:
        return list(self._entries)

    def state_dict(self) -> dict:
        out = {}
        for name, entry in self._entries.items():
            value = entry.save()
            if value is not None or not entry.optional:
                out[name] = value
        return out

    def load_state_dict(self, payload: dict, payloads: list[dict] | None = None, rank: int = 0) -> None:
        """Load ``payload`` (this rank's, written by the same layout), or -- when ``payloads`` is given,
        every old rank's of another layout -- each entry by its ``reshard`` rule (``payload`` is
        then old rank 0's)."""
        for name, entry in self._entries.items():
            if entry.load is None:
                continue
            if name not in payload:
                if entry.optional:
                    continue
                raise KeyError(f"the snapshot holds no {name!r}")
            if payloads is None:
                entry.load([payload[name]] if entry.reshard == "all" else payload[name])
            elif entry.inner is not None:
                entry.inner.load_state_dict(payload[name], [p.get(name, {}) for p in payloads], rank)
            elif entry.reshard == "same":
                entry.load(payload[name])
            elif entry.reshard == "mine":
                entry.load(payloads[rank % len(payloads)][name])
            elif entry.reshard == "all":
                entry.load([p[name] for p in payloads])
            # fresh: starts afresh; layout: the reshard loaded it
