"""Pipeline parallel: stages balanced by parameters, GPipe and 1F1B each equal to one step of the
unsplit model (loss and every gradient), 1F1B holding at most P - s micro-batches in flight.

Tolerance: the only difference from the unsplit step is the order of sums -- the batch's loss is a
sum of M micro-batch means instead of one mean, and each gradient sums its micro-batches' parts.
Both sides run in float64 and are compared within ``distlab.tools.verify.step_tolerance``: every term
that feeds one value (batch x widest layer x depth) at the largest magnitude seen: about 1e-10 here,
while a wrong cut or a lost micro-batch moves values by 1e-2 or more.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distlab.errors import ConfigError
from distlab.models import GPT, task_loss
from distlab.parallel.pipeline import PipelineStage, partition
from distlab.launch.spawn import run_ranks
from distlab.tools.verify import step_tolerance



def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                         nn.Linear(16, 5))


def _gpt():
    torch.manual_seed(0)
    return GPT(256, 8, n_layer=2, n_head=2, n_embd=16)


def _data(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
    return torch.randint(0, 256, (8, 8), generator=g), torch.randint(0, 256, (8, 8), generator=g)


def _bound(full: nn.Module, x: torch.Tensor, loss: torch.Tensor, dtype=torch.float64) -> float:
    return step_tolerance(full, len(x), loss, dtype=dtype)


def _step(rank, world, kind, schedule, microbatches, virtual=1):
    build = _mlp if kind == "mlp" else _gpt
    full, model = build().double(), build().double()
    x, y = _data(kind)
    x = x.double() if x.is_floating_point() else x
    ref = task_loss(full(x), y)
    ref.backward()
    stage = PipelineStage(model, dist.group.WORLD, microbatches, schedule, virtual=virtual)
    loss = stage.train_step(x if stage.first else None, y if stage.last else None, task_loss)
    grad_diff = 0.0
    for name, layer in stage.layers.items():
        for p, q in zip(layer.parameters(), full[int(name)].parameters()):
            grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
    loss_diff = abs(loss.item() - ref.item()) if loss is not None else None
    return (stage.stage, list(stage.layers), grad_diff, loss_diff, stage.last_timing, _bound(full, x, ref),
            _bound(full, x, ref, torch.float32))


@pytest.mark.parametrize("kind,schedule,world,microbatches", [
    ("mlp", "gpipe", 2, 4), ("mlp", "1f1b", 4, 8), ("gpt", "1f1b", 2, 1), ("gpt", "1f1b", 2, 4),
    ("gpt", "gpipe", 4, 8), ("gpt", "1f1b", 4, 8)])
def test_a_pipelined_step_equals_the_unsplit_step(kind, schedule, world, microbatches):
    results = run_ranks(_step, world, kind, schedule, microbatches, timeout=120)
    layers = [name for _, names, *_ in results for name in names]
    assert layers == [str(i) for i in range(len(_mlp() if kind == "mlp" else _gpt()))]  # every layer, once, in order
    for stage, _, grad_diff, loss_diff, timing, bound, float32_bound in results:
        assert bound < float32_bound and grad_diff <= bound  # float64's bound: far tighter than float32 rounding
        assert (loss_diff is not None) == (stage == world - 1) and (loss_diff is None or loss_diff <= bound)
        assert timing["bubble_ideal"] == pytest.approx((world - 1) / (microbatches + world - 1))
        assert 0.0 <= timing["bubble_measured"] < 1.0
        # activations held at once: GPipe all M at the turn; 1F1B at most P - s
        expected = microbatches if schedule == "gpipe" else min(microbatches, world - stage)
        assert timing["in_flight_peak"] == expected


@pytest.mark.parametrize("kind,schedule,world,microbatches,virtual", [
    ("mlp", "1f1b", 2, 4, 2), ("gpt", "1f1b", 2, 4, 2), ("gpt", "zb", 2, 4, 1), ("mlp", "zb", 4, 4, 1),
    ("gpt", "zb", 2, 2, 2)])
def test_interleaved_and_zero_bubble_steps_equal_the_unsplit_step(kind, schedule, world, microbatches, virtual):
    """Interleaved 1F1B (V chunks per rank) and zero bubble (backward split into the input's and the
    weights' gradients): the unsplit step's loss and gradients, and an ideal bubble below 1F1B's."""
    results = run_ranks(_step, world, kind, schedule, microbatches, virtual, timeout=120)
    # rank r holds virtual stages r, r + P, ...: every layer once
    layers = sorted(int(name) for _, names, *_ in results for name in names)
    assert layers == list(range(len(_mlp() if kind == "mlp" else _gpt())))
    one_f_one_b = (world - 1) / (microbatches + world - 1)
    for stage, _, grad_diff, loss_diff, timing, bound, float32_bound in results:
        assert bound < float32_bound and grad_diff <= bound
        assert (loss_diff is not None) == (stage == world - 1) and (loss_diff is None or loss_diff <= bound)
        assert 0 < timing["bubble_ideal"] < one_f_one_b and 0.0 <= timing["bubble_measured"] < 1.0


def test_the_schedules_action_lists_give_the_known_bubbles():
    from distlab.parallel.pipeline import check_virtual, ideal_bubble, schedule_actions
    for p, m in ((2, 4), (4, 8), (4, 4)):  # interleaved 1F1B: (P - 1) / (V M + P - 1), Megatron's order
        for v in (2, 3):
            assert ideal_bubble(p, m, "1f1b", v) == pytest.approx((p - 1) / (v * m + p - 1))
        # zero bubble: W passes fill idle slots, within 1F1B's memory (a graph is held until its W)
        assert ideal_bubble(p, m, "zb", 1) < ideal_bubble(p, m, "1f1b", 1)
        assert ideal_bubble(p, m, "zb", 2) < ideal_bubble(p, m, "1f1b", 2)
    plan = schedule_actions("zb", 4, 1, 4)
    assert " ".join(a[0] + str(a[2]) for a in plan[3]) == "F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3"  # the last stage
    assert " ".join(a[0] + str(a[2]) for a in plan[0]) == "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3"
    assert all(sorted(a[:3] for a in acts if a[0] == "F") == [("F", 0, m) for m in range(4)] for acts in plan)
    with pytest.raises(ConfigError, match="multiple of `pp` 4"):
        check_virtual(4, 2, 6, "1f1b")
    from distlab.parallel import Strategy
    from distlab.plan.trace import trace
    from distlab.plan.machine import Link
    from distlab.plan.predict import Layout, predict
    t = trace("gpt", (8,), 256, n_layer=2, n_head=2, n_embd=16)  # 4 layers: embedding, 2 blocks, head
    p = predict(t, Layout(strategy=Strategy(pp=2, microbatches=4, pp_virtual=2), global_batch=8), Link(), None)
    assert p["pipeline"]["bubble_ideal"] == pytest.approx(1 / 9)
    assert [st["chunks"] for st in p["pipeline"]["stages"]] == [[[0, 1], [2, 3]], [[1, 2], [3, 4]]]
    with pytest.raises(ConfigError, match="GPipe"):
        check_virtual(2, 2, 4, "gpipe")


def test_stages_are_balanced_by_parameters_or_as_given():
    gpt = _gpt()  # embedding, 2 blocks, head
    assert partition(gpt, 2) == [(0, 2), (2, 4)]
    assert partition(gpt, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition(gpt, 2, balance=[1, 3]) == [(0, 1), (1, 4)]
    mlp = _mlp()  # parameters: 416 | 0 | 1056 | 0 | 528 | 0 | 85
    assert partition(mlp, 2) == [(0, 4), (4, 7)]  # a ReLU stays with the Linear before it
    assert partition(mlp, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]  # every stage has parameters to train
    with pytest.raises(ConfigError, match="4 layers with parameters.*at most 4 stages"):
        partition(mlp, 5)
    with pytest.raises(ConfigError, match="leaves stage 1 without parameters"):
        partition(mlp, 3, balance=[1, 1, 5])  # layer 1 is a ReLU
    with pytest.raises(ConfigError, match="between 1 and 4 stages"):
        partition(gpt, 5)
    with pytest.raises(ConfigError, match="summing to 4"):
        partition(gpt, 2, balance=[1, 1])


def _activation_peaks(rank, world):
    x, y = _data("gpt")
    peaks = {}
    for schedule, m in (("gpipe", 8), ("gpipe", 2), ("1f1b", 8)):  # micro-batches of one sequence
        stage = PipelineStage(_gpt(), dist.group.WORLD, m, schedule)
        stage.train_step(x[:m] if stage.first else None, y[:m] if stage.last else None, task_loss)
        peaks[schedule, m] = stage.last_timing["activation_peak_bytes"]
    return stage.stage, peaks


def _grads_by(rank, world, kind, schedule, microbatches, by_actions):
    build = _mlp if kind == "mlp" else _gpt
    x, y = _data(kind)
    stage = PipelineStage(build(), dist.group.WORLD, microbatches, schedule)
    stage.by_actions = by_actions
    loss = stage.train_step(x if stage.first else None, y if stage.last else None, task_loss)
    return loss, [p.grad.clone() for p in stage.parameters()], stage.last_timing["in_flight_peak"]


@pytest.mark.parametrize("kind,schedule,world,microbatches", [("mlp", "gpipe", 3, 4), ("mlp", "1f1b", 4, 8),
                                                              ("gpt", "1f1b", 2, 4)])
def test_the_action_list_executor_runs_gpipe_and_1f1b_as_the_plain_loops_do_bit_for_bit(kind, schedule, world,
                                                                                     microbatches):
    """The plain loops (distlab.parallel.pipeline.plain) are the oracle of the executor every other schedule runs on
    (interleaved, zero bubble): on GPipe and 1F1B the two compute the same loss and gradients bit for bit, holding
    the same micro-batches at once -- the executor's order is the loops' order."""
    plain = run_ranks(_grads_by, world, kind, schedule, microbatches, False, timeout=180)
    actions = run_ranks(_grads_by, world, kind, schedule, microbatches, True, timeout=180)
    for (loss_a, grads_a, held_a), (loss_b, grads_b, held_b) in zip(plain, actions):
        assert (loss_a is None and loss_b is None) or torch.equal(loss_a, loss_b)
        assert len(grads_a) == len(grads_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
        assert held_a == held_b


def test_1f1b_holds_less_activation_memory_than_gpipe():
    """Measured: the storages autograd saved for backward and not yet released, at their peak
    (ActivationMeter). Each micro-batch of a stage saves the same ``a`` bytes, plus the batch's
    input (or targets) that all micro-batches view -- one storage, counted once: GPipe holds all M micro-batches at the turn,
    1F1B P - s of them, so with M = 8 >= 2P 1F1B's peak is lower by exactly (M - (P - s)) a."""
    for stage, peaks in run_ranks(_activation_peaks, 2, timeout=120):
        per_microbatch = (peaks["gpipe", 8] - peaks["gpipe", 2]) // 6
        assert per_microbatch > 0
        assert peaks["1f1b", 8] == peaks["gpipe", 8] - (8 - (2 - stage)) * per_microbatch
        assert peaks["1f1b", 8] < peaks["gpipe", 8] / 3


def _checkpointed_and_scaled(rank, world, schedule, virtual):
    """One step of a GPT stage three ways: plain; with its transformer blocks checkpointed; with the
    loss scaled by 2^10 before backward (fp16's loss scaling, run here in float32) and the gradients
    unscaled after."""
    from distlab.parallel.checkpointing import block_names
    from distlab.parallel.precision import LossScaler, Precision
    x, y = _data("gpt")
    out = {}
    for name, blocks, precision in (("plain", None, None), ("ckpt", block_names(_gpt()), None),
                                    ("scaled", None, Precision("fp32", scaler=LossScaler(init_scale=2.0 ** 10)))):
        stage = PipelineStage(_gpt(), dist.group.WORLD, 4, schedule, virtual=virtual, checkpoint=blocks)
        loss = stage.train_step(x if stage.first else None, y if stage.last else None, task_loss, precision=precision)
        found = precision.scaler.unscale_(stage.parameters()) if precision is not None else False
        out[name] = ([p.grad.clone() for p in stage.parameters()], loss, stage.last_timing["activation_peak_bytes"],
                     found, sum(ck for segments in stage.segments for _, ck in segments))
    return out


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zb", 1), ("1f1b", 2)])
def test_a_stage_checkpoints_its_blocks_and_scales_its_loss_leaving_every_gradient_bitwise(schedule, virtual):
    """Exact, not within a bound: recomputing a block runs the same float operations again, and
    scaling by a power of two (then dividing by it) changes no bit of a float32 that neither
    overflows nor underflows. Checkpointing holds less for backward on every stage."""
    for out in run_ranks(_checkpointed_and_scaled, 2, schedule, virtual, timeout=120):
        plain_grads, plain_loss, plain_held, _, none = out["plain"]
        assert none == 0 and out["ckpt"][4] == 1  # each rank holds one of the two blocks
        for name in ("ckpt", "scaled"):
            grads, loss, held, found, _ = out[name]
            assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)), name
            assert (loss is None and plain_loss is None) or torch.equal(loss, plain_loss)
            assert found is False
        assert out["ckpt"][2] < plain_held


def _bf16_step(rank, world):
    from distlab.parallel.precision import Precision
    full, model = _gpt(), _gpt()
    x, y = _data("gpt")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = task_loss(full(x), y)
    ref.backward()
    stage = PipelineStage(model, dist.group.WORLD, 1, "1f1b")
    loss = stage.train_step(x if stage.first else None, y if stage.last else None, task_loss,
                            precision=Precision("bf16"))
    same = [torch.equal(p.grad, q.grad) for name, layer in stage.layers.items()
            for p, q in zip(layer.parameters(), full[int(name)].parameters())]
    return same, None if loss is None else torch.equal(loss, ref.detach())


def test_a_stage_runs_its_forwards_under_autocast():
    # One micro-batch: every stage runs the very operations of the single process's autocast step, so
    # the loss and every gradient are bitwise its; a stage that ran float32 would differ at bf16's 4e-3.
    (same0, loss0), (same1, loss1) = run_ranks(_bf16_step, 2, timeout=120)
    assert all(same0) and all(same1) and loss0 is None and loss1 is True


def _one_stage_overflows(rank, world):
    from distlab.parallel import Strategy, build_mesh, parallelize
    from distlab.parallel.precision import LossScaler, Precision
    engine = parallelize(_mlp(), Strategy(pp=world, microbatches=2, activation_checkpointing=True),
                         build_mesh(1, pp=world))
    engine.precision = Precision("fp32", scaler=LossScaler(init_scale=2.0 ** 8))  # fp16's scaler, on the CPU
    opt = engine.attach(torch.optim.SGD(engine.parameters(), lr=0.1))  # attaching chooses the scaled verdict
    x, y = _data("mlp")
    before = [p.detach().clone() for p in engine.parameters()]
    hook = engine.parameters()[0].register_hook(lambda g: g * float("inf")) if rank == 0 else None
    engine.forward_backward(x, y, engine.loss)
    stepped = engine.step(opt)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.parameters()))
    if hook is not None:
        hook.remove()
    opt.zero_grad(set_to_none=True)
    engine.forward_backward(x, y, engine.loss)
    blocks = sum(ck for segments in engine.schedule.stage.segments for _, ck in segments)
    return stepped, unchanged, engine.precision.scaler.scale_value, engine.step(opt), blocks


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage():
    # Only the first stage's gradients are inf; the last stage's are finite and must not step alone.
    # (The engine also hands the stages the model's blocks to checkpoint: an nn.Sequential's are its layers.)
    results = run_ranks(_one_stage_overflows, 2, timeout=120)
    for stepped, unchanged, scale, next_stepped, _ in results:
        assert (stepped, unchanged, scale, next_stepped) == (False, True, 2.0 ** 7, True)
    assert [r[4] for r in results] == [4, 3]  # the 7 layers, cut after the second ReLU


def _uneven(rank, world, via_engine):
    model = _mlp()
    x, y = torch.randn(10, 12), torch.randint(0, 5, (10,))  # 10 samples do not split into 4 micro-batches
    try:
        if via_engine:
            from distlab.parallel import Strategy, build_mesh, parallelize
            engine = parallelize(model, Strategy(pp=world, microbatches=4), build_mesh(1, pp=world))
            engine.forward_backward(x, y, engine.loss)
        else:
            stage = PipelineStage(model, dist.group.WORLD, 4, "1f1b")
            stage.train_step(x if stage.first else None, y if stage.last else None, task_loss, batch_size=10)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("via_engine", [False, True])
def test_a_batch_that_does_not_split_into_equal_microbatches_is_refused_on_every_stage(via_engine):
    # Before: 3, 3, 3, 1 each divided by 4 (a wrong loss and gradients), and a middle stage waited forever.
    # A middle stage that did not refuse would wait for the first stage's activations: run_ranks reports
    # that as a hang (its timeout) or a communication error, never as this ConfigError on every rank.
    for message in run_ranks(_uneven, 3, via_engine, timeout=60):
        assert message and "a batch of 10 samples does not split into 4 equal pipeline micro-batches" in message


def _accumulate(rank, world):
    from distlab.parallel import Strategy, build_mesh, parallelize
    engine = parallelize(_mlp(), Strategy(grad_accum=4), build_mesh(1))
    with pytest.raises(ConfigError, match="a batch of 10 samples does not split into 4 equal accumulation"):
        engine.forward_backward(torch.randn(10, 12), torch.randint(0, 5, (10,)), engine.loss)
    return True


def test_accumulation_never_drops_the_samples_left_over():
    assert run_ranks(_accumulate, 2, timeout=60) == [True, True]
