"""Gradient clipping by the global norm (Engine.clip_grad_norm_, --clip-grad-norm): the whole model's
norm with every parameter counted once, on every layout, equal to torch.nn.utils.clip_grad_norm_ on one
process."""

from __future__ import annotations

import pytest
import torch

from distlab.errors import NonFiniteError
from distlab.tools.verify import EPS32, gradient_tolerance, parse_strategy, verify


def test_clipping_equals_one_process_on_every_layout():
    """4 ranks, a max-norm below every step's norm (every step clipped): data parallel, ZeRO-3, tensor
    and sequence parallel (replicated LayerNorms), a pipeline, context parallel and expert parallel
    each train the single-process model within verify's bound, and log the norm one process computes."""
    cases = ["bucketed+accum=2+clip", "zero=3+clip", "allreduce+tp=2+sp+gpt+clip", "bucketed+pp=2+mb=2+clip",
             "bucketed+cp=2+gpt+clip", "bucketed+ep=2+gpt-moe+clip"]
    steps = 3
    for r in verify([parse_strategy(c) for c in cases], 4, steps=steps, timeout=300):
        assert r["passed"] and r["clipped_steps"] == steps, r
        # the first step's norm, from equal weights: gradients summed in another order (each entry within
        # gradient_tolerance relative), then n squares summed in another order (n eps / 2, Higham)
        bound = gradient_tolerance(r["global_batch_size"]) + r["num_parameters"] * EPS32 / 2
        assert r["first_rel_grad_norm_diff"] <= bound, r


def _weights(rank, world):
    from distlab.models import build_model
    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    model = build_model("gpt", (8,), 16, n_layer=1, n_head=2, n_embd=8)
    engine = parallelize(model, Strategy(tp=2), build_mesh(2))
    names = [d["name"] for d in __import__("distlab.parallel.placement", fromlist=["x"]).placement_of(engine)["params"]]
    return dict(zip(names, engine._norm_weights.tolist()))


def test_each_parameter_counts_once_over_its_replicas():
    """dp 2 x tp 2: a tensor-parallel slice is held by its 2 data-parallel replicas (weight 1/2), a
    LayerNorm by all 4 ranks (1/4)."""
    from distlab.launch.spawn import run_ranks
    weights = run_ranks(_weights, 4, timeout=120)[0]
    assert weights["1.attn.q.weight"] == 0.5 and weights["1.ln1.weight"] == 0.25, weights


def test_a_non_finite_norm_scales_nothing_and_the_step_refuses_it():
    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    engine = parallelize(torch.nn.Sequential(torch.nn.Linear(3, 2)), Strategy(), build_mesh(1))
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    engine.forward_backward(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), engine.loss)
    weight = engine.module[0].weight
    weight.grad[0, 0] = float("inf")
    before = weight.grad.clone()
    assert torch.isinf(engine.clip_grad_norm_(0.1))
    assert torch.equal(weight.grad, before)
    with pytest.raises(NonFiniteError):
        engine.step(opt)


def test_a_clipped_step_takes_its_verdict_from_the_norm_without_another_pass(monkeypatch):
    """The norm is finite iff every gradient is: a clipped step reads it instead of passing over the
    gradients again -- and still refuses a NaN (one NaN entry, the norm NaN, nothing applied)."""
    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    engine = parallelize(torch.nn.Sequential(torch.nn.Linear(3, 2)), Strategy(), build_mesh(1))
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)

    def no_second_pass(*a):
        raise AssertionError("a clipped step passed over the gradients again")
    monkeypatch.setattr(engine.verdict, "find", no_second_pass)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    engine.forward_backward(x, y, engine.loss)
    engine.clip_grad_norm_(0.1)
    assert engine.step(opt)
    engine.forward_backward(x, y, engine.loss)
    engine.module[0].bias.grad[1] = float("nan")
    weights = [p.detach().clone() for p in engine.parameters()]
    assert torch.isnan(engine.clip_grad_norm_(0.1))
    with pytest.raises(NonFiniteError):
        engine.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, engine.parameters()))


def test_clipping_is_refused_when_it_is_not_positive(refused_here):
    proc = refused_here("train", "--model", "mlp", "--dataset", "synthetic:1x4x4:2", "--clip-grad-norm", "0")
    assert proc.returncode == 2 and "--clip-grad-norm must be positive" in proc.stderr


def test_the_report_draws_the_gradient_norm_of_a_clipped_run(tmp_path):
    """A run's metrics.jsonl with grad_norm (every logged step of a --clip-grad-norm run) gets the norm's
    curve; a run without it gets none."""
    import json

    from distlab.tools.report import write_report
    for name, norms in (("clipped", True), ("plain", False)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "epoch": 0, "loss": 2.0 / s, "lr": 0.1, "time_s": 0.1 * s,
                 **({"grad_norm": 3.0 / s} if norms else {})} for s in range(1, 5)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        inputs = write_report([str(run)], tmp_path / f"{name}.html", images=tmp_path / f"img-{name}")
        drawn = [p.name for p in inputs.images if "gradient-norm" in p.name]
        assert len(drawn) == (1 if norms else 0), [p.name for p in inputs.images]


def _replicated_norm(rank, world):
    import torch.distributed as dist

    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    whole = __import__("copy").deepcopy(model)
    engine = parallelize(model, Strategy("bucketed"), build_mesh(1))
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    engine.forward_backward(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4], engine.loss)
    collective = dist.all_reduce

    def refused(*args, **kwargs):
        raise AssertionError("a collective in clipping")
    dist.all_reduce = refused
    try:
        norm = engine.clip_grad_norm_(1e-3).item()
    finally:
        dist.all_reduce = collective
    engine.loss(whole(x), y).backward()
    return norm, torch.nn.utils.clip_grad_norm_(whole.parameters(), 1e-3).item()


def test_replicas_clip_by_their_own_norm_without_a_collective():
    """Data parallel's replicas hold the same reduced gradients: each computes the global norm alone
    (a blocking all-reduce of one number cost ~15% of the main job's 7 ms step on 2 cores)."""
    from distlab.launch.spawn import run_ranks
    norms = run_ranks(_replicated_norm, 2, timeout=60)
    assert norms[0][0] == norms[1][0]  # the same bits on both replicas
    # the mean gradient of 8 samples, summed in another order: gradient_tolerance relative, then 4 squares
    assert abs(norms[0][0] - norms[0][1]) <= (gradient_tolerance(8) + 4 * EPS32) * norms[0][1]
