"""Bytes of model state held by one rank: parameters, gradients and optimizer state.

One rule for every strategy (and for torch's, in ``bench parallel``): count each storage once,
however many tensors view it (a ZeRO parameter is a view of its padded flat buffer), count a
DTensor by its local shard, and skip storages that hold nothing (ZeRO-3's freed buffers) or live off the device
(:mod:`~distlab.parallel.offload`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from distlab.parallel.offload import off_device


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_key(storage: torch.UntypedStorage) -> int:
    """What tells ``storage`` from the others: its memory's address, or -- on the meta device, where every storage
    sits at address 0 (a dry run: ``distlab plan --dry-run``) -- the storage object's own; 0 for an empty one."""
    if not storage.nbytes():
        return 0
    return storage.data_ptr() or storage._cdata


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` and empty storages count 0)."""
    seen: set[int] = set()
    total = 0
    for t in plain(tensors):
        storage = _local(t).untyped_storage()
        key = storage_key(storage)
        if key and key not in seen and not off_device(key):  # (offloaded: held off the device)
            seen.add(key)
            total += storage.nbytes()
    return total


def plain(tensors: Iterable[torch.Tensor | None]):
    """``tensors`` with each tensor subclass that holds others (a quantized weight: its codes and scales, as
    torch's ``__tensor_flatten__`` names them) replaced by those; ``None`` left out."""
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "__tensor_flatten__") and not hasattr(t, "to_local"):
            names, _ = t.__tensor_flatten__()
            yield from plain(getattr(t, name) for name in names)
        else:
            yield t


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor of ``optimizer``'s state (torch's ZeroRedundancyOptimizer keeps its shard's in ``.optim``)."""
    if optimizer is None:
        return []
    state = getattr(optimizer, "optim", optimizer).state
    return [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of ``module``'s parameters and gradients plus ``optimizer``'s state, as held right now."""
    tensors = [t for p in module.parameters() for t in (p, p.grad)]
    return storage_bytes(tensors + optimizer_tensors(optimizer))
