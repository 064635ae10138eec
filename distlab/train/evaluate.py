"""Exact evaluation over the data-parallel ranks."""

from __future__ import annotations

import math

import torch

import torch.distributed as dist

from distlab.data.loader import EvalLoader
from distlab.models.packing import split
from distlab.parallel import Engine
from distlab.runtime import group_size, reduce_scalars

SHOWN = 36  # misclassified samples kept for a picture


MAPPED_EVAL_BATCHES = 200  # a memory-mapped corpus's default evaluation: 200 global batches (nanoGPT's eval_iters)


def first_batches(dataset, batches: int | None, batch_size: int):
    """``--eval-batches``: the first ``batches x batch_size`` samples of ``dataset`` (all of it when that is
    more, or ``batches`` is None) -- a fixed subset, the same at every evaluation, whose indices are the
    whole set's."""
    if dataset is None or batches is None or batches * batch_size >= len(dataset):
        return dataset
    return dataset.subset(torch.arange(batches * batch_size), dataset.split)


DEFAULT_EVAL_BATCH = 1000  # samples a rank scores at a time, a classifier's default


LOGITS_BUDGET = 1 << 28  # bytes of float32 logits one evaluation batch may make on a rank (256 MiB)
LOGITS_COPIES = 3  # the logits, their softmax's exponentials, the log-probabilities


def eval_batch(given: int | None, predicts_tokens: bool, micro_batch: int, logits_per_sample: int = 0) -> int:
    """The samples a rank scores at a time: ``--eval-batch-size`` as given; else, for a language model, as many
    as :data:`LOGITS_BUDGET` holds the logits of (``logits_per_sample``: tokens x this rank's vocabulary --
    what fills memory: 1,000 windows of 2,048 tokens over a 32k vocabulary would be 262 GB of float32), and
    never fewer than the training micro-batch per rank -- a 64-wide model of 256 tokens over 16-token windows
    scores ~5,000 windows at a time, not 2 (8,208 test windows took 200 s at 2); a classifier's
    :data:`DEFAULT_EVAL_BATCH`."""
    if given is not None:
        return given
    if not predicts_tokens:
        return DEFAULT_EVAL_BATCH
    fits = LOGITS_BUDGET // (LOGITS_COPIES * 4 * logits_per_sample) if logits_per_sample else 0
    return max(1, micro_batch, min(fits, DEFAULT_EVAL_BATCH * 16))


def evaluation_size(batches: int | None, batch_size: int, global_batch: int, mapped: bool) -> tuple[int | None, int]:
    """``(batches, batch size)`` an evaluation takes the first of: ``--eval-batches`` as given, else every
    sample -- except from a memory-mapped corpus, whose test split may hold millions of windows: then
    :data:`MAPPED_EVAL_BATCHES` batches of the global batch, as nanoGPT evaluates (a fixed subset, the
    same every time; ``--eval-batches`` asks for more or fewer)."""
    if batches is None and mapped:
        return MAPPED_EVAL_BATCHES, global_batch
    return batches, batch_size


class EvaluationStopped(Exception):
    """A stop signal came while an evaluation ran: every rank left it at the same batch (``reason``: why)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def outputs(engine: Engine, loader: EvalLoader, device, stop=None):
    """``(start, output, y)`` of each of ``loader``'s batches whose output this rank knows (a pipeline's last
    stage; every rank elsewhere), ``start`` its first sample's place in ``loader.indices``, ``y`` cut as
    the output is (context parallel: this rank's tokens). Every rank runs as many batches as the largest
    shard where a component exchanges data between data-parallel ranks in every forward (expert parallel's
    tokens): empty ones where its own ran out. ``stop`` (collective: :meth:`Preemption.now`) is asked before
    each of the largest shard's batches, on every rank as often: where it says why, :class:`EvaluationStopped`.
    Call it under ``torch.no_grad()``."""
    batch_size, n = loader.batch_size, len(loader.dataset)
    batches = list(zip(range(0, len(loader.indices), batch_size), loader))
    most = -(-(-(-n // engine.mesh.dp)) // batch_size)
    if engine.lockstep and batches:
        x0, y0, f0 = split(batches[0][1])
        batches += [(len(loader.indices), (x0[:0], y0[:0]) if f0 is None else (x0[:0], y0[:0], f0.rows(0, 0)))] * \
            (most - len(batches))
    for i in range(max(most, len(batches))):
        reason = stop() if stop is not None else None
        if reason:
            raise EvaluationStopped(reason)
        if i >= len(batches):
            continue
        start, (x, y, fields) = batches[i][0], split(batches[i][1])
        x, y = engine.shard(x.to(device), y.to(device))
        out = engine.infer(x, engine.shard_fields(fields.to(device) if fields is not None else None))
        if out is not None and len(y):  # (a stage before the last passed the batch on; an empty batch)
            yield start, out, y


@torch.no_grad()
def evaluate(engine: Engine, dataset, device: torch.device | str = "cpu", batch_size: int = 1000,
             details: bool = False, stop=None) -> dict:
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

    ``details`` (a classifier: one row of logits per sample): also ``confusion``, the
    ``classes x classes`` counts (row: true label, column: prediction), exact as the sums are, and
    ``misclassified``, the (index, label, prediction) of the first :data:`SHOWN` wrong test samples
    in index order -- what ``distlab report`` draws. ``stop``: :func:`outputs`'.
    """
    mesh = engine.mesh
    was_training = engine.module.training
    engine.module.eval()
    loss_sum, correct, count = 0.0, 0, 0
    k = dataset.num_classes
    details = details and not dataset.predicts_tokens  # a confusion matrix is a classifier's (K x K: not a vocabulary's)
    confusion = torch.zeros(k * k, dtype=torch.float64, device=device) if details else None
    wrong = torch.full((SHOWN, 3), -1, dtype=torch.int64, device=device) if details else None
    shown = 0
    loader = EvalLoader(dataset, rank=mesh.dp_rank, world_size=mesh.dp, batch_size=batch_size)
    for start, out, y in outputs(engine, loader, device, stop):
        loss_sum += engine.loss(out, y, reduction="sum").item()
        right, scored = engine.correct(out, y)
        correct, count = correct + right, count + scored
        if details and out.dim() == 2 and out.shape[1] == k:  # a classifier's logits, (batch, classes)
            pred = out.argmax(-1)
            confusion += torch.bincount(y * k + pred, minlength=k * k).double()
            idx = torch.as_tensor(loader.indices[start:start + len(y)], device=device)
            missed = (pred != y).nonzero().flatten()[:SHOWN - shown]
            wrong[shown:shown + len(missed)] = torch.stack([idx[missed], y[missed], pred[missed]], dim=1)
            shown += len(missed)
    engine.module.train(was_training)
    mine = [loss_sum, correct, count] if mesh.reports else [0.0, 0, 0]
    loss_sum, correct, count = reduce_scalars(mine, device=device)
    samples = len(dataset)
    result = {"test_loss": loss_sum / max(count, 1), "test_accuracy": correct / max(count, 1), "test_samples": samples}
    if dataset.predicts_tokens:  # a language model: per token (those scored), and its perplexity
        result["test_tokens"] = int(count)
        result["test_perplexity"] = math.exp(min(result["test_loss"], 700.0))  # e^700: float64's range, not inf
    if details:
        if not mesh.reports:
            confusion.zero_()
            wrong.fill_(-1)
        if group_size() > 1:
            dist.all_reduce(confusion)
            every = [torch.empty_like(wrong) for _ in range(group_size())]
            dist.all_gather(every, wrong)
            wrong = torch.cat(every)
        rows = sorted(tuple(r) for r in wrong.cpu().tolist() if r[0] >= 0)[:SHOWN]
        if confusion.sum() > 0:  # a classifier (a language model's logits are per token)
            result["confusion"] = confusion.reshape(k, k).long().cpu()
            result["misclassified"] = rows
    return result


def eval_words(record: dict) -> str:
    """The console line of an evaluation."""
    val = f" | val loss {record['val_loss']:.4f}" if "val_loss" in record else ""
    ppl = f" | perplexity {record['test_perplexity']:.2f}" if "test_perplexity" in record else ""
    if "test_reward" in record:  # prompts learned from rewards (GRPO): their greedy completions' rewards
        return (f"eval step {record['step']} (epoch {record['epoch']}) | test reward {record['test_reward']:.4f} | "
                f"rewarded {100 * record['test_accuracy']:.2f}% ({record['test_samples']:,} prompts, greedy){val}")
    if "test_reward_margin" in record:  # preference pairs (DPO)
        return (f"eval step {record['step']} (epoch {record['epoch']}) | test DPO loss {record['test_loss']:.4f} | "
                f"preference accuracy {100 * record['test_accuracy']:.2f}% ({record['test_samples']:,} pairs) | "
                f"reward margin {record['test_reward_margin']:.4f}{val}")
    scored = f"{record['test_tokens']:,} tokens of {record['test_samples']:,} windows" if "test_tokens" in record \
        else f"{record['test_samples']:,} samples"
    return (f"eval step {record['step']} (epoch {record['epoch']}) | test loss {record['test_loss']:.4f}{ppl} | "
            f"test accuracy {100 * record['test_accuracy']:.2f}% ({scored}){val}")
