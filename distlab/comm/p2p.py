"""Point-to-point messages in group ranks, counted by the accounting module.

Every distlab algorithm talks through these functions (or a :class:`Peer`, the same thing with
the connection resolved once) and nothing else. Peers are ranks *within* ``group``; zero-element
tensors are not sent (both sides know the sizes and skip alike). Messages go to the process-group
objects directly: ``dist.isend``'s Python checks cost about as much as gloo's own work for a small
message, and the ring is CPU-bound on small machines.

**One direction per socket (gloo).** gloo moves a message over one TCP connection per pair of
ranks, guarded by one lock. When both ranks of a pair send large messages to each other at once
(a ring of two, every butterfly exchange, the direct all-to-all), each sender holds the pair's
lock while it writes, the receiving network thread cannot get it to drain the socket, and on a
small machine the two end up taking turns (a several-fold slower exchange; ``docs/01-collectives.md``).
So :func:`prepare` gives each gloo group a *duplex partner*: a second gloo process group over the
same ranks (its own connections and network thread). Messages from the lower rank of a pair travel
on the group, messages from the higher rank on its partner, so every socket carries one direction.
``DISTLAB_P2P_DUPLEX=0`` turns this off (for comparison); groups of other backends never use it;
a pattern where no pair sends both ways (a ring of three or more) opts out per peer. Partners are
not known to ``torch.distributed``, so ``destroy_process_group`` leaves them: :func:`release` shuts
them down (``runtime.shutdown`` calls it, and an ``atexit`` handler does at the latest). A gloo
group torn down later, while the interpreter itself is being dismantled, can abort the process
("terminate called without an active exception") after a run that otherwise succeeded.

**A tag space per thread.** Messages match by ``(peer, tag)`` in posting order, so two threads
running collectives on the same group at once (the bucketed data-parallel sync reduces buckets on
a communication thread while backward's SyncBatchNorm reduces on the main thread) would steal each
other's messages. :func:`use_tag_space` gives a thread its own range of tags.
"""

from __future__ import annotations

import atexit
import os
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from distlab import runtime
from distlab.comm import accounting

_LINKS: dict[int, "_Links"] = {}  # id(group) -> its links, made by prepare()
_LINKS_LOCK = threading.Lock()
_THREAD = threading.local()
TAG_SPACE = 1 << 16  # tags an algorithm may use within one space


class _Links:
    """How this process reaches the members of one group: the group itself, its duplex partner
    (or None) and this process's group rank, looked up once."""

    __slots__ = ("group", "partner", "rank")

    def __init__(self, group: dist.ProcessGroup, partner) -> None:
        self.group, self.partner, self.rank = group, partner, dist.get_rank(group)


def use_tag_space(index: int) -> None:
    """Make this thread's messages use tags ``index * TAG_SPACE + tag`` (0: the default space).
    Every rank must run the matching collectives in threads with the same index."""
    _THREAD.tag_base = index * TAG_SPACE


def _tag(tag: int) -> int:
    return getattr(_THREAD, "tag_base", 0) + tag


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
    partner = dist.ProcessGroupGloo(prefix, dist.get_rank(group), dist.get_world_size(group), timeout)
    global _RELEASE_AT_EXIT
    if not _RELEASE_AT_EXIT:  # at runtime.shutdown, or at the latest before the interpreter tears itself down
        runtime.at_shutdown(release)
        atexit.register(release)
        _RELEASE_AT_EXIT = True
    return partner


_RELEASE_AT_EXIT = False


def release() -> None:
    """Shut down every duplex partner and forget every group's links (idempotent). Call it when the
    collectives are over, before or after ``destroy_process_group``: a later :func:`prepare` starts
    afresh."""
    with _LINKS_LOCK:
        links = list(_LINKS.values())
        _LINKS.clear()
    for link in links:
        shutdown = getattr(link.partner, "shutdown", None)  # torch < 2.5's gloo groups have none: dropped
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # already broken (a peer died): nothing left to free
                pass


def _resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def prepare(group: dist.ProcessGroup | None) -> None:
    """Create ``group``'s links (and duplex partner) if it has none yet. Collective: every member
    calls it, at the same collective (distlab's collectives do, before their first message)."""
    g = _resolve(group)
    with _LINKS_LOCK:  # once per process, whichever thread gets here first
        links = _LINKS.get(id(g))
        if links is None or links.group is not g:  # a new group (ids of destroyed ones can be reused)
            _LINKS[id(g)] = _Links(g, _make_partner(g))


def _links(group: dist.ProcessGroup | None) -> _Links:
    g = _resolve(group)
    links = _LINKS.get(id(g))
    if links is None or links.group is not g:  # not prepared: one direction per pair, as before
        return _Links(g, None)
    return links


def _partner(group: dist.ProcessGroup | None):
    return _links(group).partner


class Peer:
    """One peer of a group, with the connection and this thread's tags resolved once: for loops
    that send or receive many messages to the same rank (the ring's neighbours).

    ``duplex=False`` keeps both directions on the group's own connection, for patterns in which
    no pair of ranks sends to each other at once (a ring of 3 or more: each connection carries
    one direction anyway); the partner would only add a second network thread to wake. Both
    ends of a pair must pass the same value."""

    __slots__ = ("peer", "_send", "_recv", "_base")

    def __init__(self, group: dist.ProcessGroup | None, peer: int, duplex: bool = True) -> None:
        links = _links(group)
        partner = links.partner if duplex else None
        self.peer = peer
        self._send = (partner if partner is not None and links.rank > peer else links.group).send
        self._recv = (partner if partner is not None and peer > links.rank else links.group).recv
        self._base = _tag(0)

    def isend(self, t: torch.Tensor, tag: int = 0):
        n = t.numel()
        if n == 0:
            return None
        accounting.record_send(n * t.element_size())
        return self._send([t], self.peer, self._base + tag)

    def irecv(self, t: torch.Tensor, tag: int = 0):
        """Messages with the same ``(peer, tag)`` match in the order they were posted."""
        n = t.numel()
        if n == 0:
            return None
        accounting.record_recv(n * t.element_size())
        return self._recv([t], self.peer, self._base + tag)


def isend(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    return Peer(group, dst).isend(t, tag)


def irecv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0):
    """Messages with the same ``(peer, tag)`` match in the order they were posted."""
    return Peer(group, src).irecv(t, tag)


def wait_all(works) -> None:
    """Wait for every request (in order); a dead peer raises within the group's timeout."""
    for w in works:
        if w is not None:
            w.wait()


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
             group: dist.ProcessGroup | None = None) -> None:
    """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` with both in flight together."""
    wait_all([irecv(recv, src, group), isend(send, dst, group)])
