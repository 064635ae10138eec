"""How far two float computations that differ only in summation order (and in where narrow dtypes round)
may be apart: the bounds :mod:`distlab.tools.verify` checks distributed training against (its module
docstring derives them), and the tests use for their own comparisons. Machine-independent: each follows
from float32's (or the given dtype's) unit roundoff and the number and size of the terms summed."""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps


UNIT_ROUNDOFF = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # beyond float32's (counted in B eps)


def sgd_tolerance(steps: int, lr: float, batch: int, momentum: float = 0.0, precision: str = "fp32",
                  wire: str = "fp32", ranks: int = 1, clip_terms: int = 0, clip_norm: float = 1.0) -> float:
    """The module docstring's bound on how far two SGD runs that differ only in summation order
    (and in where narrow dtypes round) may drift apart: ``2 * steps * lr / (1 - momentum) * d`` with
    ``d = batch * eps32 + 4 u_precision + ranks * u_wire``, for gradient entries of at most 1.
    ``lr`` is the largest learning rate of the run. Clipping to ``clip_norm`` by the global norm of
    ``clip_terms`` gradient entries scales every entry by ``clip_norm / norm``: a sum of ``n`` squares in
    another order is within ``n eps / 2`` relative of the exact sum (Higham), its square root within half
    that, so the two runs' scales differ by ``n eps / 2`` relative at most -- and a clipped entry is at
    most ``clip_norm``: ``+ n eps / 2 x min(1, clip_norm)``."""
    d = (batch * EPS32 + 4 * UNIT_ROUNDOFF[precision] + ranks * UNIT_ROUNDOFF[wire]
         + clip_terms * EPS32 / 2 * min(1.0, clip_norm))
    return 2 * steps * lr / (1 - momentum) * d


def gradient_tolerance(batch: int, precision: str = "fp32") -> float:
    """Bound on one step's gradient entries (of at most 1) computed in two summation orders: the
    mean over ``batch`` samples rounds by ``batch * eps32`` relative, twice over (loss and backward)."""
    return 2 * (batch * EPS32 + 4 * UNIT_ROUNDOFF[precision])


def sum_tolerance(terms: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two evaluations of one sum of ``terms`` terms, each of size at most ``scale``, may be
    apart when they add in different orders (split over ranks, say): each is within
    ``gamma_(n-1) * n * scale`` of the exact sum (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 4.2; ``gamma_k = k u / (1 - k u)``, ``u = eps / 2``), so they differ by at most twice
    that: about ``n^2 * eps * scale``. For a chain of layers give the total number of terms that
    feed one value and the largest magnitude along it. Machine-independent, and in float64 many
    orders of magnitude below what a wrong shard or a missing reduction moves."""
    u = torch.finfo(dtype).eps / 2
    k = max(terms - 1, 1) * u
    return 2 * k / (1 - k) * terms * scale


def step_tolerance(model: torch.nn.Module, samples: int, *values: torch.Tensor,
                   dtype: torch.dtype = torch.float64) -> float:
    """:func:`sum_tolerance` for one forward and backward of ``model`` (call it after the backward)
    computed in another summation order -- split over ranks, micro-batches or shards. Every value
    is fed by at most ``samples`` (rows of the batch, or tokens) x the widest parameter dimension x
    the number of layers holding parameters terms, none larger than the largest magnitude among
    the parameters, their gradients and ``values`` (the loss, activations), and at least 1."""
    params = list(model.parameters())
    layers = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    widest = max(max(p.shape) for p in params)
    scale = max([1.0] + [p.detach().abs().max().item() for p in params]
                + [p.grad.abs().max().item() for p in params if p.grad is not None]
                + [v.detach().abs().max().item() for v in values])
    return sum_tolerance(samples * widest * layers, scale, dtype)


@torch.no_grad()
def evaluation_tolerance(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """How far two evaluations of ``model``'s mean cross-entropy over ``(x, y)`` may be apart when
    they batch the samples differently (split over ranks, stages or micro-batches): each logit is
    a chain of dot products (:func:`step_tolerance` for one sample), cross-entropy moves by at
    most twice its largest logit change, and the mean of ``n`` per-sample losses in another order
    adds ``sum_tolerance(n, largest loss) / n``."""
    import torch.nn.functional as F
    out = model(x)
    losses = F.cross_entropy(out, y, reduction="none")
    per_logit = step_tolerance(model, 1, x, out, dtype=out.dtype)
    return 2 * per_logit + sum_tolerance(len(x), losses.abs().max().item(), out.dtype) / len(x)
