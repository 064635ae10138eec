"""Collectives: torch's native ones and classic algorithms built from point-to-point messages.

``all_reduce(tensor, op="sum", algorithm="native", group=None)`` works in place like torch's;
``reduce_scatter(output, input)``, ``all_gather(output, input)`` and ``broadcast(tensor, src)``
follow torch's ``*_tensor`` shapes (``input``/``output`` of ``n`` times the other's size). Ops:
``sum avg max min product`` in any case, or torch's ``dist.ReduceOp``; ``avg`` is the mean over
the group. Algorithms (one module each; their ``all_reduce(buf, op, group, rank, n)`` work on a
flat contiguous buffer with the same meaning of ``op``, without the checks and accounting done here):

=================  ==========================================================================
``native``         torch.distributed's own (gloo / NCCL); bytes counted analytically
``ring``           reduce-scatter + all-gather round a ring, ``2(n-1)`` steps, streamed in segments
``ring_plain``     the same ring as the algorithm reads, one chunk a step (the tuned one's oracle)
``butterfly``      recursive halving + doubling, ``2 log2 n`` steps, any ``n`` (fold/unfold)
``butterfly_plain`` the same exchanges as the algorithm reads (the tuned one's oracle)
``direct``         all-to-all reduce-scatter + all-gather, 2 rounds of ``n-1`` messages
``gather_scatter`` everything through rank 0 (the parameter server)
``auto``           per collective and backend, the one measured fastest (:func:`resolve`)
``FILE.py:NAME``   your own all-reduce (or ``package.module:NAME``; :mod:`distlab.comm.user`)
=================  ==========================================================================

Every collective takes ``async_op=True`` and then returns a :class:`Handle` (``wait()`` completes
it and returns the output): torch's own work for ``native``, this process's communication thread
(:func:`run_async`) for distlab's algorithms. Bytes are counted here, for every algorithm:
messages as they are sent, native collectives at their analytic volume (the callers count nothing).

Any number of elements (0, 1, not divisible by the group size), any dtype that torch can add on
the device, contiguous or not, CPU or CUDA, any process group (ranks are group ranks). Tensors
must have the same size on every rank: a mismatch is caught by the transport as a message-size
error where a message differs (it is not checked up front, which would cost a collective).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Callable

import torch
import torch.distributed as dist

from distlab.comm import accounting, butterfly, butterfly_plain, direct, gather_scatter, p2p, ring, ring_plain
from distlab.comm.accounting import CommStats, bytes_sent, counting
from distlab.comm.ops import NATIVE, OPS, check_op, finish
from distlab.errors import ConfigError

ALGORITHMS: dict[str, ModuleType | object | None] = {
    "native": None, "ring": ring, "ring_plain": ring_plain, "butterfly": butterfly, "butterfly_plain": butterfly_plain,
    "direct": direct, "gather_scatter": gather_scatter,
}
ALIASES = {"gather-scatter": "gather_scatter", "torch": "native", "recursive-halving": "butterfly",
           "ring-plain": "ring_plain", "butterfly-plain": "butterfly_plain"}
BUILT_IN = tuple(ALGORITHMS)  # (a user's own, once named, joins ALGORITHMS too)


def check_algorithm(name: str) -> str:
    """``name``'s algorithm (an alias resolved; the user's own ``FILE.py:NAME`` loaded and registered)."""
    name = ALIASES.get(name, name)
    if name not in ALGORITHMS and ":" in name:
        from distlab.comm import user  # (loaded only by a run that names its own)
        ALGORITHMS[name] = user.UserCollective.load(name)
    if name not in ALGORITHMS and name != "auto":
        raise ConfigError(f"unknown collective algorithm {name!r}; choose one of: {', '.join(BUILT_IN)}, auto, or "
                          f"your own all-reduce as path/to/file.py:NAME or package.module:NAME")
    return name


def resolve(algorithm: str, collective: str, group: dist.ProcessGroup | None = None) -> str:
    """The algorithm that runs ``collective`` (``all_reduce``, ``reduce_scatter``, ``all_gather``,
    ``broadcast``) for ``algorithm``: itself, or for ``auto`` the one measured fastest on the
    group's backend -- NCCL's own on NCCL; on gloo its own all-reduce and broadcast, but distlab's
    ring for reduce-scatter and all-gather, which take gloo 1.5-3x as long at every size from
    4 KB to 64 MB (``distlab bench collectives``; docs/01)."""
    algorithm = check_algorithm(algorithm)
    if algorithm != "auto":
        return algorithm
    if (collective in ("reduce_scatter", "all_gather") and dist.is_initialized()
            and dist.get_backend(group) == "gloo"):
        return "ring"
    return "native"


def _group_info(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D view of ``t`` (a copy if ``t`` is not contiguous)."""
    return (t if t.is_contiguous() else t.contiguous()).view(-1)


def _into(result: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``buf``'s values in ``result`` (where ``buf`` was a contiguous copy of it); returns ``result``."""
    if buf.data_ptr() != result.data_ptr() or not result.is_contiguous():
        result.copy_(buf.view_as(result))
    return result


class Handle:
    """A collective under way (``async_op=True``): :meth:`wait` completes it and returns its output.

    One type whatever runs the collective -- torch's work object for the native ones (then
    ``avg``'s division and the copy back into a non-contiguous output), or a future on this
    process's communication thread for distlab's algorithms (:func:`run_async`). Waiting twice is
    waiting once."""

    __slots__ = ("_finish", "_result", "_notify")

    def __init__(self, finish: Callable[[], torch.Tensor], notify: Callable[[Callable[[], None]], None] | None = None):
        self._finish, self._result, self._notify = finish, None, notify

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from whichever thread completes the collective) once it has completed:
        now if it has, or if what runs it cannot say (then at the latest at :meth:`wait`)."""
        if self._notify is None or self._finish is None:
            callback()
        else:
            self._notify(callback)

    @classmethod
    def completed(cls, result: torch.Tensor) -> "Handle":
        handle = cls(lambda: result)
        handle.wait()
        return handle


_THREAD: ThreadPoolExecutor | None = None
_THREAD_LOCK = threading.Lock()


def run_async(fn: Callable[..., torch.Tensor], *args, **kwargs) -> Handle:
    """Run ``fn(*args, **kwargs)`` -- distlab collectives, or a composite of them (a compression
    codec) -- on this process's communication thread and return its :class:`Handle`.

    One thread, first come first served: every rank must submit the same collectives in the same
    order (as every rank must call collectives in the same order anyway). It sends in its own tag
    space (:func:`p2p.use_tag_space` 1), so the main thread's collectives on the same group cannot
    take its messages."""
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None:
            _THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distlab-comm",
                                         initializer=p2p.use_tag_space, initargs=(1,))
    future = _THREAD.submit(fn, *args, **kwargs)
    return Handle(future.result, lambda cb: future.add_done_callback(lambda f: cb()))


def _when_done(work, callback: Callable[[], None]) -> None:
    """``callback()`` when torch's ``work`` completes (its future; at once where the backend has none)."""
    try:
        future = work.get_future()
    except (RuntimeError, AttributeError):
        callback()
        return
    future.add_done_callback(lambda f: callback())


def _native(name: str, sent: int, received: int, start: Callable, finish: Callable[[], torch.Tensor],
            async_op: bool) -> torch.Tensor | Handle:
    """Start a native collective (``start()`` returns torch's work), count its analytic bytes, and
    finish it now or at the handle's wait."""
    accounting.record_call(f"{name}/native")
    accounting.record_analytic(sent, received)
    work = start()
    handle = Handle(lambda: (work.wait(), finish())[1], lambda cb: _when_done(work, cb))
    return handle if async_op else handle.wait()


def _done(result: torch.Tensor, async_op: bool) -> torch.Tensor | Handle:
    return Handle.completed(result) if async_op else result


def all_reduce(tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", algorithm: str = "native",
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> torch.Tensor | Handle:
    """Reduce ``tensor`` over the group, in place, and return it (``async_op``: its :class:`Handle`)."""
    algorithm, op = resolve(algorithm, "all_reduce", group), check_op(op, tensor.dtype)
    if async_op and algorithm != "native":
        return run_async(all_reduce, tensor, op, algorithm, group)
    rank, n = _group_info(group)
    if n == 1:
        accounting.record_call(f"all_reduce/{algorithm}")
        return _done(tensor, async_op)
    buf = _flat(tensor)
    if algorithm == "native":
        volume = accounting.allreduce_bytes_per_rank(buf.numel() * buf.element_size(), n)
        return _native("all_reduce", volume, volume,
                       lambda: dist.all_reduce(buf, op=NATIVE[op], group=group, async_op=True),
                       lambda: (finish(op, buf, n), _into(tensor, buf))[1], async_op)
    accounting.record_call(f"all_reduce/{algorithm}")
    p2p.prepare(group)
    ALGORITHMS[algorithm].all_reduce(buf, op, group, rank, n)  # divides for avg itself
    return _into(tensor, buf)


def _check_sizes(out: torch.Tensor, inp: torch.Tensor, n: int, name: str) -> None:
    if out.dtype != inp.dtype:
        raise ConfigError(f"{name}: output is {out.dtype} but input is {inp.dtype}")


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those.
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_native_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str | dist.ReduceOp = "sum", algorithm: str = "native",
                   group: dist.ProcessGroup | None = None, scratch: bool = False,
                   async_op: bool = False) -> torch.Tensor | Handle:
    """``output`` (k elements) on group rank ``r`` = reduction of ``input[r*k:(r+1)*k]`` (n*k elements).
    ``scratch=True`` lets distlab's algorithms reduce inside ``input`` (its contents are then
    undefined) instead of a copy of it: a copy of a large buffer can cost as much as the reduction.
    Returns ``output`` (``async_op``: its :class:`Handle`)."""
    algorithm, op = resolve(algorithm, "reduce_scatter", group), check_op(op, input.dtype)
    rank, n = _group_info(group)
    _check_sizes(output, input, n, "reduce_scatter")
    if input.numel() != n * output.numel():
        raise ConfigError(f"reduce_scatter: input has {input.numel()} elements, expected {n} x output's "
                          f"{output.numel()} = {n * output.numel()}")
    if async_op and algorithm != "native":
        return run_async(reduce_scatter, output, input, op, algorithm, group, scratch)
    out, inp = _flat(output), _flat(input)
    if n == 1:
        accounting.record_call(f"reduce_scatter/{algorithm}")
        out.copy_(inp)
        return _done(_into(output, out), async_op)
    if algorithm == "native":
        volume = (n - 1) * inp.numel() * inp.element_size() // n
        return _native("reduce_scatter", volume, volume,
                       lambda: _native_reduce_scatter(out, inp, op=NATIVE[op], group=group, async_op=True),
                       lambda: (finish(op, out, n), _into(output, out))[1], async_op)
    accounting.record_call(f"reduce_scatter/{algorithm}")
    p2p.prepare(group)
    ALGORITHMS[algorithm].reduce_scatter(out, inp, op, group, rank, n, scratch)  # divides for avg itself
    return _into(output, out)


def all_gather(output: torch.Tensor, input: torch.Tensor, algorithm: str = "native",
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> torch.Tensor | Handle:
    """``output[r*k:(r+1)*k]`` = group rank ``r``'s ``input`` (k elements each). Returns ``output``
    (``async_op``: its :class:`Handle`)."""
    algorithm = resolve(algorithm, "all_gather", group)
    rank, n = _group_info(group)
    _check_sizes(output, input, n, "all_gather")
    if output.numel() != n * input.numel():
        raise ConfigError(f"all_gather: output has {output.numel()} elements, expected {n} x input's "
                          f"{input.numel()} = {n * input.numel()}")
    if async_op and algorithm != "native":
        return run_async(all_gather, output, input, algorithm, group)
    out, inp = _flat(output), _flat(input)
    if n == 1:
        accounting.record_call(f"all_gather/{algorithm}")
        out.copy_(inp)
        return _done(_into(output, out), async_op)
    if algorithm == "native":
        volume = (n - 1) * out.numel() * out.element_size() // n
        return _native("all_gather", volume, volume,
                       lambda: _native_all_gather(out, inp, group=group, async_op=True),
                       lambda: _into(output, out), async_op)
    accounting.record_call(f"all_gather/{algorithm}")
    p2p.prepare(group)
    ALGORITHMS[algorithm].all_gather(out, inp, group, rank, n)
    return _into(output, out)


def broadcast(tensor: torch.Tensor, src: int = 0, algorithm: str = "native",
              group: dist.ProcessGroup | None = None, async_op: bool = False) -> torch.Tensor | Handle:
    """Copy group rank ``src``'s ``tensor`` to every rank, in place (``async_op``: its :class:`Handle`)."""
    algorithm = resolve(algorithm, "broadcast", group)
    rank, n = _group_info(group)
    if not 0 <= src < n:
        raise ConfigError(f"broadcast: src {src} is outside the group's ranks 0..{n - 1}")
    if async_op and algorithm != "native":
        return run_async(broadcast, tensor, src, algorithm, group)
    if n == 1:
        accounting.record_call(f"broadcast/{algorithm}")
        return _done(tensor, async_op)
    buf = _flat(tensor)
    if algorithm == "native":
        nbytes = buf.numel() * buf.element_size()
        root = src if group is None else dist.get_global_rank(group, src)
        return _native("broadcast", nbytes if rank == src else 0, 0 if rank == src else nbytes,
                       lambda: dist.broadcast(buf, src=root, group=group, async_op=True),
                       lambda: _into(tensor, buf), async_op)
    accounting.record_call(f"broadcast/{algorithm}")
    p2p.prepare(group)
    ALGORITHMS[algorithm].broadcast(buf, src, group, rank, n)
    return _into(tensor, buf)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, dst: int = 0,
           group: dist.ProcessGroup | None = None) -> list[torch.Tensor] | None:
    """torch's ``gather`` (native only), counted: every rank's ``tensor`` into ``dst``'s ``gather_list``
    (``dst`` a group rank; None elsewhere). Returns ``gather_list``."""
    rank, n = _group_info(group)
    nbytes = tensor.numel() * tensor.element_size()
    root = dst if group is None else dist.get_global_rank(group, dst)
    return _native("gather", 0 if rank == dst else nbytes, (n - 1) * nbytes if rank == dst else 0,
                   lambda: dist.gather(tensor, gather_list, dst=root, group=group, async_op=True),
                   lambda: gather_list, False)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, src: int = 0,
            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch's ``scatter`` (native only), counted: ``src``'s ``scatter_list[r]`` into rank ``r``'s
    ``tensor`` (``src`` a group rank). Returns ``tensor``."""
    rank, n = _group_info(group)
    nbytes = tensor.numel() * tensor.element_size()
    root = src if group is None else dist.get_global_rank(group, src)
    return _native("scatter", (n - 1) * nbytes if rank == src else 0, 0 if rank == src else nbytes,
                   lambda: dist.scatter(tensor, scatter_list, src=root, group=group, async_op=True),
                   lambda: tensor, False)


__all__ = ["ALGORITHMS", "OPS", "CommStats", "Handle", "all_gather", "all_reduce", "broadcast", "bytes_sent",
           "check_algorithm", "counting", "gather", "reduce_scatter", "resolve", "run_async", "scatter"]
