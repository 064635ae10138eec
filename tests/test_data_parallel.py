"""Data parallel on W gloo ranks equals single-process training on the same global batches.

Tolerance. The only difference between the runs is float32 summation order: the mean gradient
over the global batch of 12 is a sum of per-sample terms grouped per rank, then summed across
ranks (gloo) and divided, instead of summed in one go. Each gradient entry then differs by at
most ~12 ulp relative (float32 eps = 1.2e-7, so ~1.5e-6 relative), and with |grad| <= ~1,
lr 0.1 and momentum 0.9 over 10 steps the parameter drift is bounded by about
10 steps x 10 (momentum amplification) x 0.1 x 1.5e-6 = 1.5e-5 in the worst case; in practice
errors do not all align and stay near 1e-7. We assert ATOL = 2e-5. Leaving out the gradient
sync (the negative control) moves parameters by ~1e-2, three orders of magnitude more.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from distlab import runtime
from distlab.data import load_dataset
from distlab.data.sampler import sequential_batches
from distlab.models import build_model
from distlab.testing import run_ranks
from distlab.train import Trainer, TrainConfig, evaluate

ATOL = 2e-5


def _config(dp_sync: str, out: str | None = None) -> TrainConfig:
    # 96 samples / global batch 12 = 8 steps per epoch; 10 steps cross an epoch (reshuffle).
    return TrainConfig(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:96", epochs=2,
                       max_steps=10, global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd",
                       momentum=0.9, weight_decay=1e-4, seed=3, log_every=1, dp_sync=dp_sync, out=out,
                       progress=False)


def _reference(cfg: TrainConfig):
    """Plain single-process SGD on the sequential global batches (no distlab trainer involved)."""
    data = load_dataset(cfg.dataset, "train", seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, widths=cfg.mlp_widths)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    losses, step, epoch = [], 0, 0
    while step < cfg.max_steps:
        for idx in sequential_batches(len(data), batch_size=cfg.global_batch_size, shuffle=True, seed=cfg.seed,
                                      epoch=epoch):
            if step == cfg.max_steps:
                break
            x, y = data.batch(torch.tensor(idx))
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
        epoch += 1
    return [p.detach() for p in model.parameters()], losses


def _train(rank, world, cfg: TrainConfig, skip_sync: bool = False):
    trainer = Trainer(cfg, runtime.from_process_group())
    if skip_sync:
        trainer.model.method.sync = lambda module: None
    trainer.fit()
    return [p.detach().clone() for p in trainer.net.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("dp_sync", ["allreduce", "ddp"])
@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_equals_single_process(tmp_path, dp_sync, world):
    cfg = _config(dp_sync, out=str(tmp_path))
    ref_params, ref_losses = _reference(cfg)
    per_rank = run_ranks(_train, world, cfg, timeout=120)

    for other in per_rank[1:]:  # replicas stay bitwise in sync: every rank applies the same update
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0], other))
    assert _max_diff(per_rank[0], ref_params) <= ATOL

    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 11))
    assert max(abs(r["loss"] - ref) for r, ref in zip(logged, ref_losses)) <= ATOL


def test_negative_control_without_gradient_sync_diverges():
    cfg = _config("allreduce")
    ref_params, _ = _reference(cfg)
    per_rank = run_ranks(_train, 2, cfg, True, timeout=120)
    assert _max_diff(per_rank[0], ref_params) > 100 * ATOL
    assert _max_diff(per_rank[0], per_rank[1]) > 100 * ATOL  # replicas drift apart


def _evaluate(rank, world, spec):
    data = load_dataset(spec, "test", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes, widths=(8,))
    return evaluate(model, data, runtime.from_process_group(), batch_size=4)


def test_distributed_evaluation_is_exact_when_the_test_set_does_not_divide():
    spec = "synthetic:1x4x4:3:100"  # test split: 25 samples, over 3 ranks: 9 + 8 + 8
    data = load_dataset(spec, "test", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes, widths=(8,))
    with torch.no_grad():
        x, y = data.batch(torch.arange(len(data)))
        out = model(x)
        loss, correct = F.cross_entropy(out, y, reduction="sum").item(), int((out.argmax(1) == y).sum())
    results = run_ranks(_evaluate, 3, spec, timeout=60)
    for r in results:
        assert r["test_samples"] == 25
        assert r["test_accuracy"] == correct / 25
        assert abs(r["test_loss"] - loss / 25) <= 1e-6 * max(1.0, abs(loss / 25))


def _die_mid_training(rank, world, cfg: TrainConfig):
    import os

    from distlab.errors import DistributedError
    trainer = Trainer(cfg, runtime.from_process_group())
    sync = trainer.model.method.sync

    def sync_or_die(module):
        if rank == 1 and trainer.step == 3:
            os._exit(17)  # a worker vanishing mid-step, without a word
        sync(module)

    trainer.model.method.sync = sync_or_die
    try:
        trainer.fit()
    except DistributedError as exc:
        raise AssertionError(f"clear error: {exc}") from None
    return "finished"


def test_a_peer_dying_mid_step_is_a_clear_error_not_a_hang():
    from distlab.testing import RankFailure
    with pytest.raises(RankFailure) as err:
        run_ranks(_die_mid_training, 2, _config("allreduce"), timeout=90)
    text = str(err.value)
    assert "clear error: rank 0: communication failed at step 4" in text
    assert "exited with code 17" in text and "still running" not in text
