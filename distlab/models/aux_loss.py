"""The share of a step's loss one forward carries, for a loss a model adds inside its forward.

A mixture of experts adds its balance loss's gradient in backward where its output is
(:class:`~distlab.models.moe.MoE`), never through the loss a schedule divides. A step of ``k``
micro-batches divides each micro-batch's task loss by ``k``; the schedule that runs them says the
same share here (``with step_share(1 / k):`` around the step, backward and recomputation included),
so the added loss is divided alike -- Megatron-LM's schedules set ``MoEAuxLossAutoScaler``'s scale
the same way. Outside a schedule (one forward, one backward) the share is 1.
"""

from __future__ import annotations

import contextlib
import contextvars

_SHARE = contextvars.ContextVar("distlab_step_share", default=1.0)


@contextlib.contextmanager
def step_share(share: float):
    """Within: each forward's loss counts ``share`` of the step's (1 / micro-batches)."""
    token = _SHARE.set(float(share))
    try:
        yield
    finally:
        _SHARE.reset(token)


def current_share() -> float:
    """The share set by the innermost :func:`step_share` (1 outside any)."""
    return _SHARE.get()
