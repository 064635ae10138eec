"""Exact evaluation over the data-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab.data.loader import EvalLoader
from distlab.parallel import Mesh
from distlab.runtime import reduce_scalars


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, mesh: Mesh, device: torch.device | str = "cpu",
             batch_size: int = 1000) -> dict:
    """Exact global loss and accuracy: disjoint shards, per-rank sums, one all-reduce.

    Shards cover the dataset exactly once whatever its size (no padding, no drop), so the
    result equals a single process evaluating the whole set, up to float64 summation order.
    Shards go to the data-parallel ranks (the ranks of a tensor-parallel group evaluate the same
    samples together) and the sums to the data-parallel group. BatchNorm uses its running statistics.
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in EvalLoader(dataset, rank=mesh.dp_rank, world_size=mesh.dp, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += int((out.argmax(1) == y).sum())
        count += len(y)
    model.train(was_training)
    loss_sum, correct, count = reduce_scalars([loss_sum, correct, count], group=mesh.dp_group, device=device)
    return {"test_loss": loss_sum / max(count, 1), "test_accuracy": correct / max(count, 1),
            "test_samples": int(count)}
