"""ZeRO stages 1-3 on real gloo ranks: equal to single-process training, the bytes they send,
the memory they hold, and their sharded state.

Tolerance: the data-parallel bound (tests/test_data_parallel.py): gradients are the same
averages, reduce-scattered instead of all-reduced, so runs differ by float32 summation order
only: distlab.tools.verify's bound, 2.9e-5 over 10 SGD steps (Adam has none: its runs are compared
bitwise on resume and resharding, tests/test_snapshot.py and tests/test_reshard.py). A ZeRO that summed instead of averaged, updated the wrong slice or
missed an all-gather is off by O(1e-2) or more (the control below).
"""

import pytest
import torch
from torch import nn

from distlab import comm, runtime
from distlab.errors import ConfigError
from distlab.parallel import Zero
from distlab.parallel.cost import Optim
from distlab.plan.trace import trace
from distlab.parallel.zero.cost import zero_peak_bytes
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig
from distlab.tools.verify import reference_run, tolerance
from tests.conftest import patience


def _cfg(zero, **kw):
    # 64 inputs -> 32 -> 16 -> 4: on 3 ranks no weight divides evenly (padding is exercised).
    settings = dict(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:96", epochs=2, max_steps=10,
                    global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd", momentum=0.9,
                    weight_decay=1e-4, seed=3, log_every=1, dp_sync="allreduce", progress=False, verbose=False,
                    eval_every_epoch=False, zero=zero)
    return TrainConfig.from_flags(**{**settings, **kw})


ATOL = tolerance(_cfg(1))  # 2 x 10 steps x lr 0.1 / (1 - 0.9) x batch 12 x eps32 = 2.9e-5


def _train(rank, world, cfg):
    trainer = Trainer(cfg.validate(world), runtime.from_process_group())
    summary = trainer.fit()
    freed = all(u.full.untyped_storage().nbytes() == 0 for u in trainer.engine.grad_sync.units) if cfg.strategy.zero == 3 else None
    return trainer.full_parameters(), [r["loss"] for r in trainer.history], summary, freed


def _train_each(rank, world, cfgs):
    """Several trainings in one set of processes (one spawn instead of one per config)."""
    return [_train(rank, world, cfg)[2] for cfg in cfgs]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# bucket_mb 0.002 (2 KB): the 64x32 weight alone, the rest in buckets of several units, so
# stages 1-2 launch several reduce-scatters during backward (and stage 2 waits for the one before).
CASES = [(1, 2, {}), (2, 3, {}), (3, 3, {}), (3, 2, {"bucket_mb": 0.002}),
         (2, 2, {"grad_accum": 2}), (3, 4, {"tp": 2}), (3, 2, {"collective": "ring"}),
         (1, 3, {"bucket_mb": 0.002}), (2, 3, {"bucket_mb": 0.002, "grad_accum": 2}),
         (2, 2, {"bucket_mb": 0.002, "collective": "ring"})]


def _train_all(rank, world, cfgs):
    return [_train(rank, world, cfg) for cfg in cfgs]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_training_equals_single_process(world):
    """Every case of CASES on ``world`` ranks, in one process group (one start-up)."""
    cases = [(zero, extra) for zero, w, extra in CASES if w == world]
    cfgs = [_cfg(zero, **extra) for zero, extra in cases]
    per_rank = run_ranks(_train_all, world, cfgs, timeout=300)
    for i, ((zero, extra), cfg) in enumerate(zip(cases, cfgs)):
        ref_params, ref_losses = reference_run(cfg)
        for params, losses, summary, freed in (results[i] for results in per_rank):
            assert _max_diff(params, ref_params) <= ATOL, (zero, extra)
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= ATOL, (zero, extra)
            assert summary["strategy"]["zero"] == zero
            if zero == 3:
                assert freed, (zero, extra)  # between steps a rank holds only its shards


def test_zero_with_a_sum_instead_of_a_mean_diverges():
    """Negative control: the same run with gradients summed over ranks (2x too large on 2 ranks)."""
    cfg = _cfg(3)
    ref_params, _ = reference_run(cfg)
    results = run_ranks(_train_summing, 2, cfg, timeout=120)
    assert _max_diff(results[0], ref_params) > 100 * ATOL


def _train_summing(rank, world, cfg):
    real = comm.reduce_scatter
    comm.reduce_scatter = lambda out, inp, op="sum", **kw: real(out, inp, op="sum", **kw)
    try:
        return _train(rank, world, cfg)[0]
    finally:
        comm.reduce_scatter = real


def test_bytes_per_step_match_the_analytic_volumes():
    """ZeRO-1/2 send what data parallel's all-reduce sends; ZeRO-3 about 1.5x that (an extra all-gather).
    World 2 and even layer sizes: no padding, so the volumes are exact."""
    summaries = run_ranks(_train_each, 2, [_cfg(zero, max_steps=3) for zero in (0, 1, 2, 3)], timeout=120)[0]
    sent = {zero: s["comm_bytes_per_step"] for zero, s in zip((0, 1, 2, 3), summaries)}
    params = 64 * 32 + 32 + 32 * 16 + 16 + 16 * 4 + 4
    assert sent[0] == 2 * (2 - 1) * params * 4 // 2  # the textbook all-reduce volume: 2(n-1)/n x bytes
    assert sent[1] == sent[2] == sent[0]
    # ZeRO-3: 1.5x, less the first layer's second all-gather -- its input needs no gradient, so
    # its backward computes the weight's gradient only, which needs no weight
    first = (64 * 32 + 32) * 4 * (2 - 1) // 2
    assert sent[3] == sent[0] * 3 // 2 - first


def test_model_state_memory_shrinks_with_each_stage():
    """Peak bytes of parameters + gradients + optimizer state per rank (Adam: 16 bytes/parameter
    unsharded). Buckets of 0.1 MB (three here), so ZeRO-2 frees the first bucket's gradients
    before the last is sent, which ZeRO-1 holds to the end of backward. ZeRO-3 on 4 ranks: within
    (unsharded / 4) x 1.1 plus the largest layer once -- its weight gradient is computed after
    its full weight is released, and the largest layer (0.79 of the parameters) dominates."""
    cfg = dict(mlp_widths=(256, 256), optimizer="adam", lr=0.005, max_steps=2, global_batch_size=16, bucket_mb=0.1)
    summaries = run_ranks(_train_each, 4, [_cfg(z, **cfg) for z in (0, 1, 2, 3)], timeout=180)[0]
    held = {z: s["model_state_bytes_per_rank"] for z, s in zip((0, 1, 2, 3), summaries)}
    params = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 4 + 4
    largest = 256 * 256 * 4  # bytes of the largest layer's weight
    assert held[0] >= 16 * params  # params + grads + Adam's two moments
    assert held[0] > held[1] > held[2] > held[3]
    assert held[3] <= held[0] / 4 * 1.1 + largest
    t = trace("mlp", (1, 8, 8), 4, widths=(256, 256))  # the plan follows the buckets byte for byte
    for z in (1, 2):
        assert zero_peak_bytes(t, z, 4, Optim.of("adam"), bucket_mb=0.1) == held[z], z


def _state_round_trip(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    zero = Zero(model, 3)
    full = zero.full_state_dict()
    saved = zero.sharded_state_dict()
    with torch.no_grad():
        for unit in zero.units:
            unit.shard.zero_()
    zeroed = zero.full_state_dict()
    zero.load_sharded_state_dict(saved)
    restored = zero.full_state_dict()
    errors = []
    other = Zero(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), 3)
    try:
        other.load_sharded_state_dict(saved)
    except ConfigError as exc:
        errors.append(str(exc))
    stage2 = Zero(nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)), 2)
    try:
        stage2.load_sharded_state_dict(saved)
    except ConfigError as exc:
        errors.append(str(exc))
    return ([torch.equal(full[k], reference[k]) for k in reference], float(zeroed["0.weight"].abs().max()),
            [torch.equal(restored[k], reference[k]) for k in reference], errors)


def test_full_and_sharded_state_dicts_round_trip_and_refuse_another_layout():
    for same, zeroed, restored, errors in run_ranks(_state_round_trip, 3, timeout=60):
        assert all(same) and zeroed == 0.0 and all(restored)
        assert "its parameter 0.weight has 35 elements, this model's 0.weight has 40" in errors[0]
        assert "zero_stage 3" in errors[1] and "`zero`" in errors[1]


def _gathered_during_forward(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    zero = Zero(model, 3)
    names = {id(m.weight): name for name, m in model.named_children() if isinstance(m, nn.Linear)}
    seen, linear = [], nn.functional.linear

    def watching(x, weight, bias=None):  # what is gathered while each layer computes
        seen.append((names[id(weight)], sorted(u.name.split(".")[0] for u in zero.units
                                               if u.gathered and u.name.endswith("weight"))))
        return linear(x, weight, bias)

    nn.functional.linear = watching
    steps = []
    try:
        for _ in range(2):  # the first forward learns the order; the second prefetches by it
            seen.clear()
            before = sorted(u.name for u in zero.units if u.gathered)
            loss = zero(torch.randn(4, 6)).sum()
            between = sorted(u.name for u in zero.units if u.gathered)
            loss.backward()
            zero.sync_gradients()
            after = sorted(u.name for u in zero.units if u.gathered)
            steps.append((before, list(seen), between, after))
    finally:
        nn.functional.linear = linear
    return steps


def test_zero3_holds_the_running_layer_in_full_and_prefetches_the_next():
    for steps in run_ranks(_gathered_during_forward, 2, timeout=60):
        for before, seen, between, after in steps:
            assert before == between == after == []  # outside forward/backward: shards only
        assert steps[0][1] == [(n, [n]) for n in ("0", "2", "4")]
        assert steps[1][1] == [("0", ["0", "2"]), ("2", ["2", "4"]), ("4", ["4"])]


def test_incompatible_zero_flags_are_refused():
    with pytest.raises(ConfigError, match="`zero` 2 does its own gradient sync.*`dp_sync` ddp"):
        _cfg(2, dp_sync="ddp").validate(2)
    with pytest.raises(ConfigError, match="`zero` 1 does its own gradient sync.*`dp_sync` gather-scatter"):
        _cfg(1, dp_sync="gather-scatter").validate(2)
    with pytest.raises(ConfigError, match="unknown `zero` 4; choose one of: 0"):
        _cfg(4).validate(2)
    with pytest.raises(ConfigError, match="`find_unused` is implied by `zero`"):
        _cfg(1, find_unused=True).validate(2)



def _state_copied_a_module_at_a_time(rank, world, impl):
    """The whole model's state under ZeRO-3, and how many of its parameters were whole at each copy."""
    from distlab.parallel import placement
    trainer = Trainer(_cfg(3, zero_impl=impl, max_steps=2).validate(world), runtime.from_process_group())
    trainer.fit()
    params = list(trainer.engine.module.parameters())
    copy, whole = placement.value_copy, []

    def watching(t):  # (every copy of a parameter goes through value_copy)
        whole.append(sum(p.untyped_storage().nbytes() >= p.numel() * p.element_size() for p in params))
        return copy(t)

    placement.value_copy = watching
    try:
        state = trainer.engine.full_state_dict()
    finally:
        placement.value_copy = copy
    after = sum(p.untyped_storage().nbytes() >= p.numel() * p.element_size() for p in params)
    return whole, after, [v for k, v in state.items()], trainer.full_parameters()


@pytest.mark.parametrize("impl", ["tuned", "plain"])
def test_zero3s_whole_state_is_gathered_a_module_at_a_time(impl):
    """The final model file and every export read the whole state: under ZeRO-3 each module's parameters are
    gathered, copied and let go in turn -- at most one layer's weight and bias whole at any copy (the whole
    model gathered beside its copy held it twice: a 1B model's 8 GB a rank) -- and what is copied is the model."""
    for whole, after, state, full in run_ranks(_state_copied_a_module_at_a_time, 2, impl, timeout=patience(120)):
        assert whole and max(whole) <= 2 and after == 0, (whole, after)
        assert len(state) == len(full) and all(torch.equal(a, b) for a, b in zip(state, full))
