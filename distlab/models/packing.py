"""Packed windows (``--pack``): several fine-tuning records laid one after another in a window, each
attending to itself only -- a document-causal mask -- with its positions starting again from 0, so each
record computes what it computes alone, while the window wastes no place on padding.

A packed batch carries its structure beside its tokens (the token ids are plain ids): a :class:`Packed`,
each token's position in its record and each position's record number. The data makes it
(:meth:`Packed.of_starts`, from where each record starts); the Engine cuts it as it cuts the batch (the
positions go with their tokens to a context-parallel rank; the record numbers stay whole, the keys every
query may read) and :func:`bind`\\ s it to the model's :class:`Packing` slot before each micro-batch's
forward and backward (a recomputed block reads the window its forward read), where every attention reads
it. A batch without one is a plain window: nothing is read from the device to tell.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from distlab.models.contract import ModelContract


@dataclass(frozen=True)
class Packed:
    """The structure of a packed batch of ``B`` windows: ``positions`` ``(B, t)``, each of this rank's
    tokens' position in its record (0 at its start); ``records`` ``(B, T)``, each position of the *whole*
    window's record number (1, 2, ... -- non-decreasing along a window), which every query's keys are
    read from. ``t == T`` but where context parallel gave this rank its tokens only."""

    positions: torch.Tensor
    records: torch.Tensor

    @classmethod
    def of_starts(cls, starts: torch.Tensor) -> "Packed":
        """The structure of windows ``(B, T)`` whose ``True`` entries start a record."""
        t = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
        began = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values  # where the token's record began
        return cls(t - began, starts.long().cumsum(dim=1))

    def __len__(self) -> int:
        return len(self.records)

    def to(self, device, non_blocking: bool = False) -> "Packed":
        return Packed(self.positions.to(device, non_blocking=non_blocking),
                      self.records.to(device, non_blocking=non_blocking))

    def rows(self, start: int, stop: int) -> "Packed":
        """Windows ``start..stop-1`` (a micro-batch's)."""
        return Packed(self.positions[start:stop], self.records[start:stop])

    def chunk(self, n: int) -> list["Packed"]:
        """``n`` micro-batches of it, as ``Tensor.chunk`` cuts the tokens."""
        return [Packed(p, r) for p, r in zip(self.positions.chunk(n), self.records.chunk(n))]

    def with_positions(self, positions: torch.Tensor) -> "Packed":
        """The same windows, this rank's tokens' positions only (context parallel's cut)."""
        return Packed(positions, self.records)


def cut(fields: Packed | None, shard) -> Packed | None:
    """This rank's part of ``fields``: the positions cut as ``shard`` (the Engine's) cuts their tokens, the
    record numbers whole (the keys a query may read); None for a plain batch."""
    return fields.with_positions(shard(fields.positions)[0]) if fields is not None else None


def split(batch) -> tuple[torch.Tensor, torch.Tensor, Packed | None]:
    """``(inputs, targets, structure)`` of a loader's batch: ``(x, y)`` or, packed, ``(x, y, Packed)``."""
    return (batch[0], batch[1], batch[2]) if len(batch) > 2 else (batch[0], batch[1], None)


def moved(batch, device) -> tuple[torch.Tensor, torch.Tensor, Packed | None]:
    """:func:`split` of ``batch``, each part on ``device`` (copied without waiting where it can be)."""
    return tuple(t.to(device, non_blocking=True) for t in batch) + ((None,) if len(batch) == 2 else ())


@dataclass
class Packing:
    """The slot a model's attentions read a packed batch's structure from (``fields``: None for a plain
    one), set by :func:`bind` before a micro-batch's forward and again before its backward (activation
    checkpointing recomputes the forward there; a pipeline runs other micro-batches in between)."""

    fields: Packed | None = None


_SLOTS: "weakref.WeakKeyDictionary[nn.Module, list[Packing]]" = weakref.WeakKeyDictionary()


def slots(module: nn.Module) -> list[Packing]:
    """The :class:`Packing` slots the modules of ``module`` read (one per decoder, shared by its blocks)."""
    if module not in _SLOTS:
        found = {id(m.packing): m.packing for m in module.modules()
                 if isinstance(m, ModelContract) and m.packing is not None}
        _SLOTS[module] = list(found.values())
    return _SLOTS[module]


def bind(module: nn.Module, fields: Packed | None) -> None:
    """Make every attention of ``module`` read ``fields`` (None: a plain window) from now on."""
    for slot in slots(module):
        slot.fields = fields
