"""Collectives: torch's native ones and classic algorithms built from point-to-point messages.

``all_reduce(tensor, op="sum", algorithm="native", group=None)`` works in place like torch's;
``reduce_scatter(output, input)``, ``all_gather(output, input)`` and ``broadcast(tensor, src)``
follow torch's ``*_tensor`` shapes (``input``/``output`` of ``n`` times the other's size). Ops:
``sum avg max min product`` in any case, or torch's ``dist.ReduceOp``; ``avg`` is the mean over
the group. Algorithms (one module each; their ``all_reduce(buf, op, group, rank, n)`` work on a
flat contiguous buffer with the same meaning of ``op``, without the checks and accounting done here):

=================  ==========================================================================
``native``         torch.distributed's own (gloo / NCCL); bytes counted analytically
``ring``           reduce-scatter + all-gather round a ring, ``2(n-1)`` steps
``butterfly``      recursive halving + doubling, ``2 log2 n`` steps, any ``n`` (fold/unfold)
``direct``         all-to-all reduce-scatter + all-gather, 2 rounds of ``n-1`` messages
``gather_scatter`` everything through rank 0 (the parameter server)
``auto``           per collective and backend, the one measured fastest (:func:`resolve`)
=================  ==========================================================================

Any number of elements (0, 1, not divisible by the group size), any dtype that torch can add on
the device, contiguous or not, CPU or CUDA, any process group (ranks are group ranks). Tensors
must have the same size on every rank: a mismatch is caught by the transport as a message-size
error where a message differs (it is not checked up front, which would cost a collective).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist

from distlab.comm import accounting, butterfly, direct, gather_scatter, p2p, ring
from distlab.comm.accounting import CommStats, counting
from distlab.comm.ops import NATIVE, OPS, check_op, finish
from distlab.errors import ConfigError

ALGORITHMS: dict[str, ModuleType | None] = {
    "native": None, "ring": ring, "butterfly": butterfly, "direct": direct, "gather_scatter": gather_scatter,
}
ALIASES = {"gather-scatter": "gather_scatter", "torch": "native", "recursive-halving": "butterfly"}


def check_algorithm(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in ALGORITHMS and name != "auto":
        raise ConfigError(f"unknown collective algorithm {name!r}; choose one of: {', '.join(ALGORITHMS)}, auto")
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


def all_reduce(tensor: torch.Tensor, op: str | dist.ReduceOp = "sum", algorithm: str = "native",
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over the group, in place, and return it."""
    algorithm, op = resolve(algorithm, "all_reduce", group), check_op(op, tensor.dtype)
    rank, n = _group_info(group)
    accounting.record_call(f"all_reduce/{algorithm}")
    if n == 1:
        return tensor
    buf = _flat(tensor)
    if algorithm == "native":
        dist.all_reduce(buf, op=NATIVE[op], group=group)
        nbytes = buf.numel() * buf.element_size()
        accounting.record_analytic(accounting.allreduce_bytes_per_rank(nbytes, n),
                                   accounting.allreduce_bytes_per_rank(nbytes, n))
        finish(op, buf, n)
    else:
        p2p.prepare(group)
        ALGORITHMS[algorithm].all_reduce(buf, op, group, rank, n)  # divides for avg itself
    if buf.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(buf.view_as(tensor))
    return tensor


def _check_sizes(out: torch.Tensor, inp: torch.Tensor, n: int, name: str) -> None:
    if out.dtype != inp.dtype:
        raise ConfigError(f"{name}: output is {out.dtype} but input is {inp.dtype}")


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has only those.
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_native_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str | dist.ReduceOp = "sum", algorithm: str = "native",
                   group: dist.ProcessGroup | None = None, scratch: bool = False) -> torch.Tensor:
    """``output`` (k elements) on group rank ``r`` = reduction of ``input[r*k:(r+1)*k]`` (n*k elements).
    ``scratch=True`` lets distlab's algorithms reduce inside ``input`` (its contents are then
    undefined) instead of a copy of it: a copy of a large buffer can cost as much as the reduction."""
    algorithm, op = resolve(algorithm, "reduce_scatter", group), check_op(op, input.dtype)
    rank, n = _group_info(group)
    _check_sizes(output, input, n, "reduce_scatter")
    if input.numel() != n * output.numel():
        raise ConfigError(f"reduce_scatter: input has {input.numel()} elements, expected {n} x output's "
                          f"{output.numel()} = {n * output.numel()}")
    accounting.record_call(f"reduce_scatter/{algorithm}")
    out, inp = _flat(output), _flat(input)
    if n == 1:
        out.copy_(inp)
    elif algorithm == "native":
        _native_reduce_scatter(out, inp, op=NATIVE[op], group=group)
        nbytes = inp.numel() * inp.element_size()
        accounting.record_analytic((n - 1) * nbytes // n, (n - 1) * nbytes // n)
        finish(op, out, n)
    else:
        p2p.prepare(group)
        ALGORITHMS[algorithm].reduce_scatter(out, inp, op, group, rank, n, scratch)  # divides for avg itself
    if out.data_ptr() != output.data_ptr() or not output.is_contiguous():
        output.copy_(out.view_as(output))
    return output


def all_gather(output: torch.Tensor, input: torch.Tensor, algorithm: str = "native",
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``output[r*k:(r+1)*k]`` = group rank ``r``'s ``input`` (k elements each)."""
    algorithm = resolve(algorithm, "all_gather", group)
    rank, n = _group_info(group)
    _check_sizes(output, input, n, "all_gather")
    if output.numel() != n * input.numel():
        raise ConfigError(f"all_gather: output has {output.numel()} elements, expected {n} x input's "
                          f"{input.numel()} = {n * input.numel()}")
    accounting.record_call(f"all_gather/{algorithm}")
    out, inp = _flat(output), _flat(input)
    if n == 1:
        out.copy_(inp)
    elif algorithm == "native":
        _native_all_gather(out, inp, group=group)
        nbytes = out.numel() * out.element_size()
        accounting.record_analytic((n - 1) * nbytes // n, (n - 1) * nbytes // n)
    else:
        p2p.prepare(group)
        ALGORITHMS[algorithm].all_gather(out, inp, group, rank, n)
    if out.data_ptr() != output.data_ptr() or not output.is_contiguous():
        output.copy_(out.view_as(output))
    return output


def broadcast(tensor: torch.Tensor, src: int = 0, algorithm: str = "native",
              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Copy group rank ``src``'s ``tensor`` to every rank, in place."""
    algorithm = resolve(algorithm, "broadcast", group)
    rank, n = _group_info(group)
    if not 0 <= src < n:
        raise ConfigError(f"broadcast: src {src} is outside the group's ranks 0..{n - 1}")
    accounting.record_call(f"broadcast/{algorithm}")
    if n == 1:
        return tensor
    buf = _flat(tensor)
    if algorithm == "native":
        dist.broadcast(buf, src=src if group is None else dist.get_global_rank(group, src), group=group)
        nbytes = buf.numel() * buf.element_size()
        accounting.record_analytic(nbytes if rank == src else 0, 0 if rank == src else nbytes)
    else:
        p2p.prepare(group)
        ALGORITHMS[algorithm].broadcast(buf, src, group, rank, n)
    if buf.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(buf.view_as(tensor))
    return tensor


__all__ = ["ALGORITHMS", "OPS", "CommStats", "all_gather", "all_reduce", "broadcast", "check_algorithm",
           "counting", "reduce_scatter", "resolve"]
