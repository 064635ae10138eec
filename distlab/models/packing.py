"""Packed windows (``--pack``): several fine-tuning records laid one after another in a window, each
attending to itself only -- a document-causal mask -- with its positions starting again from 0, so each
record computes what it computes alone, while the window wastes no place on padding.

A packed window stores the token that starts a record as ``-(token + 1)`` (the data's mark:
:func:`distlab.data.sft.mark_start`); :func:`unpack` reads the tokens, each token's position within its
record and its record's number back from those marks. A window without marks is a plain one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packing:
    """What the model's embedding read of the window it was given last: ``found`` ``(positions, records)``
    of a packed one (None: a plain window) -- read by every attention of the model, in forward and again
    where activation checkpointing recomputes it (the same window: its backward comes before the next one)."""

    found: tuple[torch.Tensor, torch.Tensor] | None = None


def unpack(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(tokens, positions, records)`` of a packed batch ``idx`` ``(B, t)``, each ``(B, t)``: the token ids,
    each one's position in its record (0 at its start), and which record of the window it is in (1, 2, ...);
    None for a batch without a record mark (a plain window)."""
    if idx.is_floating_point() or idx.is_meta:  # (a model traced on the meta device reads plain windows)
        return None
    starts = idx < 0
    if not bool(starts.any()):
        return None
    tokens = torch.where(starts, -idx - 1, idx)
    t = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
    began = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values  # where the token's record began
    return tokens, t - began, starts.long().cumsum(dim=1)
