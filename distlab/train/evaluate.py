"""Exact evaluation over the data-parallel ranks."""

from __future__ import annotations

import torch

from distlab.data.loader import EvalLoader
from distlab.parallel import Engine
from distlab.runtime import reduce_scalars


@torch.no_grad()
def evaluate(engine: Engine, dataset, device: torch.device | str = "cpu", batch_size: int = 1000) -> dict:
    """Exact global loss and accuracy of ``engine``'s model: disjoint shards, per-rank sums, one
    all-reduce. For a language model both are per token: ``test_loss`` in nats per token,
    ``test_accuracy`` the share of next tokens predicted exactly, ``test_tokens`` how many.

    Shards cover the dataset exactly once whatever its size (no padding, no drop), so the
    result equals a single process evaluating the whole set, up to float64 summation order.
    Shards go to the data-parallel ranks (the ranks of a tensor-parallel group or of a pipeline
    evaluate the same samples together); one rank per shard (:attr:`Mesh.reports`: tensor-parallel
    rank 0 of the last stage) contributes its sums to one all-reduce over the world. Each batch goes
    through :meth:`Engine.infer <distlab.parallel.Engine.infer>` (along the pipeline, if there is
    one) and is scored by :meth:`Engine.loss <distlab.parallel.Engine.loss>` and ``correct``, which
    know when the logits are sharded. BatchNorm uses its running statistics.
    """
    mesh = engine.mesh
    was_training = engine.module.training
    engine.module.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in EvalLoader(dataset, rank=mesh.dp_rank, world_size=mesh.dp, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        out = engine.infer(x)
        if out is None:  # a pipeline stage before the last: it passed the batch on
            continue
        loss_sum += engine.loss(out, y, reduction="sum").item()
        right, scored = engine.correct(out, y)
        correct, count = correct + right, count + scored
    engine.module.train(was_training)
    mine = [loss_sum, correct, count] if mesh.reports else [0.0, 0, 0]
    loss_sum, correct, count = reduce_scalars(mine, device=device)
    samples = len(dataset)
    result = {"test_loss": loss_sum / max(count, 1), "test_accuracy": correct / max(count, 1), "test_samples": samples}
    if count != samples:
        result["test_tokens"] = int(count)
    return result
