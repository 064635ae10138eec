"""Ignored targets (``IGNORE_INDEX``, a fine-tuning prompt's tokens): every loss path scores none of them
and every layout takes the step of the mean over the global batch's kept targets -- what one process
computes with ``F.cross_entropy(..., ignore_index=-100)`` -- not a mean of per-rank or per-micro-batch
means, which would weigh a target by how many others its shard kept."""

from __future__ import annotations

import pytest
import torch

from distlab.data import load_dataset
from distlab.errors import ConfigError
from distlab.models import IGNORE_INDEX, task_correct, task_loss
from distlab.tools.verify import parse_strategy, verify


def test_masked_synthetic_text_ignores_a_seeded_share_of_its_targets_the_same_in_every_load():
    a = load_dataset("synthetic-text:4000:masked=0.3", "train", block_size=8)
    b = load_dataset("synthetic-text:4000:masked=0.3", "train", block_size=8)
    x, y = a.batch(torch.arange(len(a)))
    assert torch.equal(y, b.batch(torch.arange(len(b)))[1]) and a.ignores_targets
    share = (y == IGNORE_INDEX).float().mean().item()
    assert 0.25 < share < 0.35  # 3,992 targets, each ignored with probability 0.3
    plain = load_dataset("synthetic-text:4000", "train", block_size=8)
    assert not plain.ignores_targets and torch.equal(x, plain.batch(torch.arange(len(plain)))[0])
    kept = y != IGNORE_INDEX
    assert torch.equal(y[kept], plain.batch(torch.arange(len(plain)))[1][kept])
    with pytest.raises(ConfigError, match="masked=F"):
        load_dataset("synthetic-text:4000:masked=2", "train")


def test_the_task_loss_and_accuracy_count_kept_targets_only():
    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    y[0, :3] = IGNORE_INDEX
    kept = y != IGNORE_INDEX
    assert task_loss(out, y).item() == pytest.approx(
        task_loss(out, y, reduction="sum").item() / kept.sum().item(), rel=1e-6)
    assert task_correct(out, y)[1] == 7 and task_correct(out, y)[0] == int((out.argmax(-1) == y)[kept].sum())


def test_every_layout_takes_the_global_mean_over_kept_targets():
    """verify's +mask cases on 4 ranks: data parallel with accumulation, data x tensor parallel (the
    vocabulary-parallel loss, smoothed), data x pipeline, data x context parallel and the mixture of
    experts with expert parallel -- each within its float32 bound of one process on the same batches.
    (Without the global weighting the accumulated, pipelined and context-parallel runs are ~1e-3 off.)"""
    cases = ["bucketed+accum=2+gpt+mask", "allreduce+tp=2+gpt+smooth+mask", "bucketed+pp=2+mb=4+gpt+mask",
             "bucketed+cp=2+gpt+mask", "bucketed+ep=2+gpt-moe+mask"]
    records = verify([parse_strategy(c) for c in cases], 4, steps=3, timeout=300)
    assert all(r["passed"] for r in records), [(r["strategy"], r["max_abs_param_diff"], r["tolerance"]) for r in records]


def test_an_odd_world_weighs_each_kept_target_alike():
    records = verify([parse_strategy("allreduce+gpt+mask")], 3, steps=3, timeout=300)
    assert records[0]["passed"], records


def test_mask_is_for_the_transformer():
    with pytest.raises(ConfigError, match=r"\+mask .* add \+gpt"):
        parse_strategy("bucketed+mask")
