"""A resumed run's first backward, replayed before its first step where the gradient sync needs it:
torch's DDP re-cuts its buckets after the first backward (in the order gradients arrived), so a
resumed run that did not replay it would reduce in other buckets -- other float sums -- than the
uninterrupted run."""

from __future__ import annotations

import torch


def prime(engine, x: torch.Tensor, y: torch.Tensor) -> None:
    """Before the first step of a resumed run: replay the backward after which torch's DDP re-cuts
    its buckets (in the order gradients arrived), so the resumed run reduces in the same buckets --
    the same float sums -- as the uninterrupted one, whose buckets were re-cut after its first step.
    Evaluation mode, one micro-batch, RNG restored and gradients dropped: nothing else changes."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    # A compression hook counts and remembers the replayed pass (torch's writes into its P and Q in place).
    sync_state = _cloned(engine.grad_sync.sync_state_dict())
    was_training = engine.module.training
    engine.module.eval()
    try:
        micro = len(x) // engine.strategy.grad_accum
        x, y = engine.shard(x[:micro], y[:micro])
        engine.loss(engine(x), y).backward()
    finally:
        engine.module.train(was_training)
        for p in engine.module.parameters():
            p.grad = None
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        engine.grad_sync.load_sync_state_dict(sync_state)


def _cloned(obj):
    """A copy of nested dicts and lists whose tensors are copies too."""
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj
