"""ZeRO's units and buckets: each parameter flattened, zero-padded to a multiple of the group size
and split evenly (rank ``r`` owns elements ``[r*S, (r+1)*S)``); stages 1-2 group units into buckets."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from distlab import comm
from distlab.runtime.meta import adopt

COALESCE_BELOW = 1 << 16  # elements: smaller units share collectives


def goes_alone(numel: int) -> bool:
    """Whether a unit of ``numel`` elements gets collectives of its own (else it shares them)."""
    return numel >= COALESCE_BELOW


@dataclass(frozen=True)
class Shard:
    """Where one parameter's shard lives: ``shard`` holds elements ``[offset, offset + numel)`` of the
    flattened parameter (zero padding past the end: ``shard.numel()`` may exceed ``numel``)."""

    name: str
    param: nn.Parameter
    shard: nn.Parameter
    offset: int
    numel: int


class Unit:
    """One parameter, flattened, zero-padded and split evenly over the group."""

    store = None  # --offload params: the OffloadStore its shard lives in (parallel.offload)
    _grad = None  # ... and the buffer its reduced gradient is kept in there

    def __init__(self, name: str, module: nn.Module, param: nn.Parameter, n: int, rank: int):
        self.name, self.module, self.param, self.n, self.rank = name, module, param, n, rank
        self.trainable = param.requires_grad  # False: frozen (a base under adapters) -- sharded, gathered, never
        self.numel = param.numel()            # reduced or updated
        self.shard_numel = math.ceil(self.numel / n)
        self.padded = self.shard_numel * n
        self.full = torch.zeros(self.padded, dtype=param.dtype, device=param.device)
        with torch.no_grad():
            view = self.full[:self.numel].view_as(param)
            view.copy_(param.detach())
            param.data = view  # the parameter now lives in the padded buffer
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(self.full[lo:lo + self.shard_numel].detach().clone(), requires_grad=self.trainable)
        self.gathered = True
        self.reduced = False

    def adopt(self, shard: torch.Tensor) -> None:
        """Built on the meta device: take ``shard`` as this rank's shard, and a padded buffer of its own for
        the full parameter (empty storage while not gathered: ZeRO-3 holds only the shard)."""
        self.full = torch.empty(self.padded, dtype=shard.dtype, device=shard.device)  # untouched: gathered into
        adopt(self.param, torch.empty(self.param.shape, dtype=shard.dtype, device=shard.device))
        self.param.data = self.full[:self.numel].view_as(self.param)  # as at construction: not an autograd view
        adopt(self.shard, shard)
        if not self.gathered:
            self.full.untyped_storage().resize_(0)

    def offloaded_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The reduced shard gradient ``grad`` as the shard holds it: itself, or (--offload params) copied into the
        store -- one buffer a unit, made at the first step -- its pages let go."""
        if self.store is None:
            return grad
        if self._grad is None:
            self._grad = self.store.empty(grad.shape, grad.dtype)
        self._grad.copy_(grad)
        self.store.release(self._grad)
        return self._grad

    def release(self) -> None:
        """An offloaded shard read (gathered): its pages let go of (:mod:`~distlab.parallel.offload`)."""
        if self.store is not None:
            self.store.release(self.shard)

    @property
    def full_bytes(self) -> int:
        return self.padded * self.full.element_size()

    def free(self) -> None:
        """Drop the full parameters (the views keep their shapes; their storage holds nothing)."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def materialize(self) -> None:
        """Give the full parameters their storage back (contents undefined until gathered)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.full_bytes)
            self.gathered = True

    def flat_grad(self) -> torch.Tensor:
        """The gradient as one padded vector: ``.grad`` itself when no padding is needed."""
        g = self.param.grad
        if g is not None and self.padded == self.numel and g.is_contiguous():
            return g.view(-1)
        base = g._base if g is not None else None
        if base is not None and base.numel() == self.padded and base.data_ptr() == g.data_ptr() and base.dim() == 1:
            return base  # already written into a padded buffer (ZeRO-3's Linear)
        flat = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device)
        if g is not None:
            flat[:self.numel].copy_(g.reshape(-1))
        return flat


class Bucket:
    """Units whose gradients travel in one reduce-scatter (stages 1-2)."""

    def __init__(self, units: list[Unit]):
        self.units = units
        self.shard_numel = sum(u.shard_numel for u in units)
        self.ready = 0  # gradients arrived this backward
        self.flat: torch.Tensor | None = None  # rank-major gradients, while the reduce-scatter runs
        self.out: torch.Tensor | None = None  # this rank's averaged slice of every unit
        self.work: comm.Handle | None = None  # its reduce-scatter under way


def cut_buckets(units: list[Unit], cap_bytes: int) -> list[Bucket]:
    """``units`` in reverse order, cut into buckets of at most ``cap_bytes`` (a larger unit alone) and one dtype."""
    out: list[Bucket] = []
    current: list[Unit] = []
    size = 0
    for u in reversed(units):
        if current and (size + u.full_bytes > cap_bytes or u.full.dtype != current[0].full.dtype):
            out.append(Bucket(current))
            current, size = [], 0
        current.append(u)
        size += u.full_bytes
    if current:
        out.append(Bucket(current))
    return out


def sharded_linear(module: nn.Module, params: list[nn.Parameter]) -> bool:
    """Whether ZeRO-3 runs ``module`` (owning ``params``) as :class:`_ShardedLinear`: an
    ``nn.Linear`` with torch's own forward whose parameters are exactly its weight and bias."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and params == [p for p in (module.weight, module.bias) if p is not None])


def describe(units: list[Unit]) -> str:
    """One collective's units in a timeline span's name: the first one's name, and how many more."""
    return units[0].name + (f" +{len(units) - 1}" if len(units) > 1 else "")
