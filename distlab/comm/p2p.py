"""Point-to-point messages in group ranks, counted by the accounting module.

Every distlab algorithm talks through these functions and nothing else. Peers are ranks *within*
``group``; zero-element tensors are not sent (both sides know the sizes and skip alike).

**One direction per socket (gloo).** gloo moves a message over one TCP connection per pair of
ranks, guarded by one lock. When both ranks of a pair send large messages to each other at once
(a ring of two, every butterfly exchange, the direct all-to-all), each sender holds the pair's
lock while it writes, the receiving network thread cannot get it to drain the socket, and on a
small machine the two end up taking turns: a 400 KB exchange took ~1 ms instead of ~0.3 ms here.
So :func:`prepare` gives each gloo group a *duplex partner*: a second gloo process group over the
same ranks (its own connections and network thread). Messages from the lower rank of a pair travel
on the group, messages from the higher rank on its partner, so every socket carries one direction.
``DISTLAB_P2P_DUPLEX=0`` turns this off (for comparison); groups of other backends never use it.

**A tag space per thread.** Messages match by ``(peer, tag)`` in posting order, so two threads
running collectives on the same group at once (the bucketed data-parallel sync reduces buckets on
a communication thread while backward's SyncBatchNorm reduces on the main thread) would steal each
other's messages. :func:`use_tag_space` gives a thread its own range of tags.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from distlab.comm import accounting

_PARTNERS: dict[int, tuple[object, object]] = {}  # id(group) -> (group, partner backend or None)
_PARTNERS_LOCK = threading.Lock()
_THREAD = threading.local()
TAG_SPACE = 1 << 16  # tags an algorithm may use within one space


def use_tag_space(index: int) -> None:
    """Make this thread's messages use tags ``index * TAG_SPACE + tag`` (0: the default space).
    Every rank must run the matching collectives in threads with the same index."""
    _THREAD.tag_base = index * TAG_SPACE


def _tag(tag: int) -> int:
    return getattr(_THREAD, "tag_base", 0) + tag


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _make_partner(group: dist.ProcessGroup):
    """A gloo backend over the same ranks with its own connections, or None where we cannot."""
    if os.environ.get("DISTLAB_P2P_DUPLEX", "1") == "0" or dist.get_backend(group) != "gloo":
        return None
    try:
        store = c10d._world.pg_map[group][1]
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, KeyError, RuntimeError):  # a torch without these internals: one direction only
        return None
    prefix = dist.PrefixStore(f"distlab-duplex/{group.group_name}/", store)
    return dist.ProcessGroupGloo(prefix, dist.get_rank(group), dist.get_world_size(group), timeout)


def prepare(group: dist.ProcessGroup | None) -> None:
    """Create ``group``'s duplex partner if it has none yet. Collective: every member calls it,
    at the same collective (distlab's collectives do, before their first message)."""
    g = group if group is not None else dist.group.WORLD
    with _PARTNERS_LOCK:  # once per process, whichever thread gets here first
        entry = _PARTNERS.get(id(g))
        if entry is None or entry[0] is not g:  # a new group (ids of destroyed ones can be reused)
            _PARTNERS[id(g)] = (g, _make_partner(g))


def _partner(group: dist.ProcessGroup | None):
    g = group if group is not None else dist.group.WORLD
    entry = _PARTNERS.get(id(g))
    return entry[1] if entry is not None and entry[0] is g else None


def isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    if t.numel() == 0:
        return None
    accounting.record_send(t.numel() * t.element_size())
    partner = _partner(group)
    if partner is not None and dist.get_rank(group) > dst:
        return partner.send([t], dst, _tag(tag))
    return dist.isend(t, _global(group, dst), group=group, tag=_tag(tag))


def irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    """Messages with the same ``(peer, tag)`` match in the order they were posted."""
    if t.numel() == 0:
        return None
    accounting.record_recv(t.numel() * t.element_size())
    partner = _partner(group)
    if partner is not None and src > dist.get_rank(group):
        return partner.recv([t], src, _tag(tag))
    return dist.irecv(t, _global(group, src), group=group, tag=_tag(tag))


def wait_all(works) -> None:
    """Wait for every request (in order); a dead peer raises within the group's timeout."""
    for w in works:
        if w is not None:
            w.wait()


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
             group: dist.ProcessGroup | None = None) -> None:
    """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` with both in flight together."""
    wait_all([irecv(recv, src, group), isend(send, dst, group)])
