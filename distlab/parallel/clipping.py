"""Gradient clipping by the global norm over the whole model, whatever the layout.

Every rank holds some of the model's gradient elements, and some elements are held by several ranks
(replicas, the tensor-parallel ranks of a LayerNorm, an expert's replicas). :func:`clip_by_global_norm_`
weighs each tensor's squared norm by one over the number of ranks that hold the same elements -- the
weights come from every rank's placements (:func:`norm_weights`) -- so one all-reduce of a single
number over the world adds up each element of the model once (Megatron's ``clip_grad_norm_fp32`` and
torchtitan's ``clip_grad_norm_`` count the same way). Where no rank holds anything the others do not
(data parallel's replicas, each with the whole reduced gradient) a rank's own norm is the global one:
no collective at all. The coefficient is torch's:
``min(1, max_norm / (norm + 1e-6))``, applied on the device without reading the norm.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist


def norm_weights(placement: dict) -> list[float]:
    """Per optimizer parameter of ``placement`` (:func:`~distlab.parallel.placement.placement_of`): one
    over the number of ranks in the world holding the same elements (collective: gathers every rank's)."""
    # a pipeline's copy of a tied parameter holds the same elements as the first stage's: counted once
    mine = [(d.get("tied_to", d["name"]), d["dim"], d["parts"], d["part"], d["start"], d["length"])
            for d in placement["params"]]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [1.0] * len(mine)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    counts = collections.Counter(key for rank in everyone for key in set(rank))
    return [1.0 / counts[key] for key in mine]


def clip_by_global_norm_(params: list[torch.Tensor], weights: torch.Tensor, max_norm: float,
                         reduce: bool = True) -> torch.Tensor:
    """Scale the gradients of ``params`` (this rank's, each weighted in ``weights``, a float64 tensor on
    their device) so that the global norm is at most ``max_norm``; returns the norm before clipping
    (0-dim float32). A non-finite norm scales nothing: the caller's step decides (fp16 skips it,
    otherwise it is refused). ``reduce`` False: every rank holds the same whole gradients (data
    parallel's replicas after their sync), so this rank's norm is the global one, with no collective."""
    held = [i for i, p in enumerate(params) if p.grad is not None]  # a parameter no loss reached has none
    grads = [params[i].grad for i in held]
    if len(held) != len(params):
        weights = weights[held]
    squares = (torch.stack(torch._foreach_norm(grads)).double().pow(2) * weights).sum() if grads else \
        torch.zeros((), dtype=torch.float64, device=weights.device)
    if reduce and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squares)
    total = squares.sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
