"""Gradient compression: fewer bytes on the wire for data parallel's all-reduce.

A *codec* turns "all-reduce these gradients to their mean" into something cheaper; the
data-parallel methods hand it one buffer at a time (a parameter under ``allreduce``, a bucket
under ``bucketed``) with the shapes of the parameters inside:

* :class:`CastCodec` (``fp16``, ``bf16``, or any ``reduce_dtype``): the buffer is divided by the
  group size in float32 (so float16's range cannot overflow in the sum), cast, summed in that
  dtype and cast back -- half the bytes, a relative error of about the dtype's unit roundoff
  times the number of ranks. What torch's ``fp16_compress_hook`` does for DDP.
* :class:`PowerSGD` (``powersgd:R``, Vogels et al., NeurIPS 2019): each gradient matrix ``M``
  (``n x m``; a conv weight viewed as ``out x rest``) is replaced by a rank-``R`` approximation
  ``P Q^T`` found by one step of subspace iteration, in two small all-reduces::

      M += e                        error feedback: what earlier steps' approximations left out
      P  = mean_ranks(M Q)          Q (m x R) is last step's: the warm start
      P  = orthonormalise(P)
      Q  = mean_ranks(M^T P)
      M' = P Q^T ;  e = M - M'      (M' is the same on every rank; e stays local)

  ``R (n + m)`` numbers travel instead of ``n m``. Vectors (biases, norm weights) and matrices too
  small to gain ``MIN_COMPRESSION_RATE`` are all-reduced as they are, in one collective per
  buffer. The error ``e`` costs one gradient's worth of memory per compressed matrix.

Compressed gradients are not the exact mean, so a compressed run is an approximation of
single-process training (``distlab verify`` reports its deviation rather than a float32 bound).
"""

from __future__ import annotations

import math
import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from distlab import comm
from distlab.comm.accounting import allreduce_bytes_per_rank
from distlab.errors import ConfigError
from distlab.parallel.precision import DTYPES
from distlab.runtime import group_size

MIN_COMPRESSION_RATE = 2.0  # compress a matrix only if it sends at most half its numbers (torch's default too)


class Codec:
    """Exact all-reduce (the base): ``all_reduce_mean(flat, shapes, key)`` averages ``flat`` in place."""

    name = "none"
    exact = True

    def all_reduce_mean(self, flat: torch.Tensor, shapes: Sequence[torch.Size], key, algorithm: str,
                        group: dist.ProcessGroup | None) -> None:
        comm.all_reduce(flat, op="avg", algorithm=algorithm, group=group)

    def state_dict(self) -> dict:
        """What the codec carries from step to step (nothing, unless it compresses with memory)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def wire_bytes(self, shapes: Sequence[torch.Size], element_size: int = 4) -> int:
        """Bytes one all-reduce input of ``shapes`` puts on the wire (before the all-reduce's own factor)."""
        return sum(math.prod(s) for s in shapes) * element_size


class CastCodec(Codec):
    """Average in a narrower dtype: pre-divide, cast, sum, cast back."""

    exact = False

    def __init__(self, dtype: str):
        self.name, self.dtype = dtype, DTYPES[dtype]

    def all_reduce_mean(self, flat, shapes, key, algorithm, group) -> None:
        wire = flat.div(group_size(group)).to(self.dtype)
        comm.all_reduce(wire, op="sum", algorithm=algorithm, group=group)
        flat.copy_(wire)

    def wire_bytes(self, shapes, element_size: int = 4) -> int:
        return sum(math.prod(s) for s in shapes) * self.dtype.itemsize


def compressible(shape: torch.Size, rank: int) -> tuple[int, int, int] | None:
    """``(rows, cols, r)`` if a gradient of ``shape`` is worth compressing at ``rank``, else None."""
    if len(shape) < 2:
        return None
    rows = shape[0]
    cols = math.prod(shape) // rows
    r = min(rank, rows, cols)
    return (rows, cols, r) if rows * cols >= MIN_COMPRESSION_RATE * r * (rows + cols) else None


def _key(k):
    """A PowerSGD state key as it was used: nested tuples (a saved one may come back as lists)."""
    return tuple(_key(v) for v in k) if isinstance(k, (list, tuple)) else k


class PowerSGD(Codec):
    """Rank-``rank`` PowerSGD with error feedback and warm start (module docstring)."""

    exact = False

    def __init__(self, rank: int, seed: int = 0):
        self.name, self.rank, self.seed = f"powersgd:{rank}", rank, seed
        self.error: dict = {}  # key -> this rank's residual of each compressed matrix
        self.q: dict = {}  # key -> last step's Q (the warm start)

    def state_dict(self) -> dict:
        """The error feedback and warm-start factors (this rank's: snapshots keep them per rank)."""
        return {"error": [[k, t] for k, t in self.error.items()], "q": [[k, t] for k, t in self.q.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.error = {_key(k): t for k, t in state.get("error", [])}
        self.q = {_key(k): t for k, t in state.get("q", [])}

    def _initial_q(self, key, cols: int, r: int, like: torch.Tensor) -> torch.Tensor:
        """The first Q of a matrix: random, and the same on every rank (seeded by its key)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(repr(key).encode()))
        return torch.randn(cols, r, generator=g).to(like.device, like.dtype)

    @torch.no_grad()
    def all_reduce_mean(self, flat, shapes, key, algorithm, group) -> None:
        mats, rest, offset = [], [], 0
        for i, shape in enumerate(shapes):
            numel = math.prod(shape)
            view = flat[offset:offset + numel]
            offset += numel
            dims = compressible(shape, self.rank)
            if dims is None:
                rest.append(view)
            else:
                mats.append(((key, i), view.view(dims[0], dims[1]), dims[2]))
        if rest:  # vectors and small matrices: one exact all-reduce for all of them
            buf = torch.cat(rest) if len(rest) > 1 else rest[0].clone()
            comm.all_reduce(buf, op="avg", algorithm=algorithm, group=group)
            pos = 0
            for view in rest:
                view.copy_(buf[pos:pos + view.numel()])
                pos += view.numel()
        if not mats:
            return
        for k, m, r in mats:
            if k in self.error:
                m.add_(self.error[k])
        qs = [self.q[k] if k in self.q else self._initial_q(k, m.shape[1], r, m) for k, m, r in mats]
        ps = self._mean([m @ q for (_, m, _), q in zip(mats, qs)], algorithm, group)
        ps = [torch.linalg.qr(p).Q for p in ps]  # orthonormal columns: a basis of M's leading subspace
        qs = self._mean([m.t() @ p for (_, m, _), p in zip(mats, ps)], algorithm, group)
        for (k, m, _), p, q in zip(mats, ps, qs):
            approx = p @ q.t()
            self.error[k] = m - approx
            m.copy_(approx)
            self.q[k] = q

    @staticmethod
    def _mean(tensors: list[torch.Tensor], algorithm, group) -> list[torch.Tensor]:
        """Average several small tensors over the group in one all-reduce."""
        buf = torch.cat([t.reshape(-1) for t in tensors])
        comm.all_reduce(buf, op="avg", algorithm=algorithm, group=group)
        out, pos = [], 0
        for t in tensors:
            out.append(buf[pos:pos + t.numel()].view_as(t))
            pos += t.numel()
        return out

    def wire_bytes(self, shapes, element_size: int = 4) -> int:
        total = 0
        for shape in shapes:
            dims = compressible(shape, self.rank)
            total += (dims[2] * (dims[0] + dims[1]) if dims else math.prod(shape)) * element_size
        return total


def parse_compression(text: str) -> tuple[str, int]:
    """``grad_compression`` -> (kind, PowerSGD rank or 0): ``powersgd:4`` -> ("powersgd", 4)."""
    kind, _, rank = str(text).partition(":")
    if kind in ("none", "fp16", "bf16") and not rank:
        return kind, 0
    if kind != "powersgd":
        raise ConfigError(f"unknown `grad_compression` {text!r}; choose one of: none, fp16, bf16, powersgd:R "
                          f"(R the rank of PowerSGD's approximation, e.g. powersgd:4)")
    try:
        r = int(rank)
    except ValueError:
        raise ConfigError(f"`grad_compression` {text!r}: give PowerSGD's rank as a positive integer, e.g. "
                          f"powersgd:4") from None
    if r < 1:
        raise ConfigError(f"`grad_compression` {text!r}: PowerSGD's rank must be at least 1 (rank 0 would send "
                          f"nothing); try powersgd:4, or none to send gradients uncompressed")
    return kind, r


def build_codec(strategy) -> Codec:
    """The codec of a :class:`~distlab.parallel.Strategy`'s ``grad_compression`` / ``reduce_dtype``."""
    kind, rank = parse_compression(strategy.grad_compression)
    if kind == "powersgd":
        return PowerSGD(rank)
    wire = strategy.wire_dtype
    return CastCodec(wire) if wire else Codec()


def bytes_per_rank(codec: Codec, shapes: Sequence[torch.Size], world_size: int, element_size: int = 4) -> int:
    """What one rank sends to average gradients of ``shapes`` with ``codec`` (bandwidth-optimal all-reduces)."""
    return allreduce_bytes_per_rank(codec.wire_bytes(shapes, element_size), world_size)
