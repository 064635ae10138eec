"""Reduction operations: how two buffers combine, and torch's ``ReduceOp`` for each.

``avg`` is a sum followed by one division by the group size; on integer tensors it is refused
(an integer mean would need a rounding rule; use ``sum`` and divide as you see fit).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist

from distlab.errors import ConfigError

OPS = ("sum", "avg", "max", "min", "product")

_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "sum": torch.Tensor.add_,  # the methods themselves: no Python frame per segment
    "avg": torch.Tensor.add_,
    "product": torch.Tensor.mul_,
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
}

NATIVE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT,
          "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


_FROM_TORCH = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
               dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def check_op(op: str | dist.ReduceOp, dtype: torch.dtype) -> str:
    """The op's name: a name in any case (``"sum"``, ``"AVG"``) or a ``torch.distributed.ReduceOp``."""
    if isinstance(op, str):
        name = op.lower()
    else:
        name = next((n for r, n in _FROM_TORCH.items() if op == r), None)
    if name not in OPS:
        raise ConfigError(f"unknown reduction op {op!r}; choose one of: {', '.join(OPS)} (or the ReduceOp of each)")
    op = name
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ConfigError(f"op 'avg' on {dtype} is not defined (integer division would round); use op 'sum' "
                          f"and divide, or reduce a floating-point tensor")
    return op


def combine(op: str, acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc = acc (op) x`` in place."""
    _COMBINE[op](acc, x)


def combiner(op: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The in-place function ``combine`` calls for ``op`` (for loops over many segments)."""
    return _COMBINE[op]


def finish(op: str, t: torch.Tensor, world_size: int) -> None:
    """After the reduction: ``avg`` divides by the group size."""
    if op == "avg" and world_size > 1:
        t.div_(world_size)


_WORKSPACE = threading.local()


def workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A scratch buffer of ``numel`` elements of ``like``'s dtype and device, reused across calls.

    Allocating fresh scratch per collective cost as much as the copies themselves: large buffers
    come straight from the OS (mmap), and every page faults and is zeroed on first touch. Kept per
    thread, so a collective running on another thread never shares one; valid until the next call.
    """
    cache = _WORKSPACE.__dict__.setdefault("buffers", {})
    key = (like.dtype, like.device)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]
