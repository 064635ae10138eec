"""The 2-D mesh and tensor-parallel layers on real gloo ranks, against the unsharded model.

Tolerance. A tensor-parallel layer computes the same dot products as the whole layer, only
summed in another order (row parallel: per-rank partial sums, then an all-reduce). The layer
tests run both in float64 and compare within ``distlab.tools.verify.step_tolerance`` (Higham's
bound for every term that feeds one value, at the largest magnitude seen: ~1e-10 here), where a
missing all-reduce (or a shard taken from the wrong rows) is off by O(0.1). Training equivalence
uses distlab.tools.verify's float32 bound for the run (2.9e-5 here).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab import comm, runtime
from distlab.errors import ConfigError
from distlab.models import build_model
from distlab.parallel import ColumnParallelLinear, RowParallelLinear, apply_tensor_parallel, build_mesh
from distlab.parallel.mesh import layout
from distlab.parallel.placement import full_parameters
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig
from distlab.tools.verify import reference_run, step_tolerance, tolerance


@pytest.mark.parametrize("world,tp,tp_groups,dp_groups", [
    (4, 1, [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    (4, 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    (4, 4, [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    (8, 2, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),  # the example
])
def test_mesh_layout_is_tensor_parallel_major(world, tp, tp_groups, dp_groups):
    groups = layout(world, tp)
    assert (groups.tp_groups, groups.dp_groups) == (tp_groups, dp_groups)
    assert groups.pp_groups == [[r] for r in range(world)]


def test_a_tp_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ConfigError, match=r"`tp` 3 does not divide the world size 4: .*1, 2, 4"):
        layout(4, 3)


def _mesh_sums(rank, world):
    mesh = build_mesh(2)
    over_tp = torch.tensor([float(rank)])
    over_dp = torch.tensor([float(rank)])
    dist.all_reduce(over_tp, group=mesh.tp_group)
    dist.all_reduce(over_dp, group=mesh.dp_group)
    return mesh.tp_rank, mesh.dp_rank, mesh.tp_ranks, mesh.dp_ranks, over_tp.item(), over_dp.item()


def test_mesh_groups_reduce_over_the_right_ranks():
    got = run_ranks(_mesh_sums, 4, timeout=60)
    #      tp_rank dp_rank tp_ranks dp_ranks  sum over TP group  sum over DP group
    assert got == [(0, 0, [0, 1], [0, 2], 1.0, 2.0), (1, 0, [0, 1], [1, 3], 1.0, 4.0),
                   (0, 1, [2, 3], [0, 2], 5.0, 2.0), (1, 1, [2, 3], [1, 3], 5.0, 4.0)]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5)).double()


def _x():
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _tp_vs_full(rank, world, style):
    """Forward/backward of the same batch through the full MLP and its TP version on this rank."""
    full = _mlp()
    sharded = apply_tensor_parallel(_mlp(), dist.group.WORLD, style)
    x = _x()
    target = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
    xf, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref_loss = F.cross_entropy(full(xf), target)
    ref_loss.backward()
    with comm.counting() as fwd:
        out = sharded(xs)
    with comm.counting() as bwd:
        F.cross_entropy(out, target).backward()
    out_diff = (out.detach() - full(x).detach()).abs().max().item()
    grad_in_diff = (xs.grad - xf.grad).abs().max().item()
    # Each shard's gradient must be the matching slice of the full layer's gradient.
    grad_diff = 0.0
    for mine, ref in zip(sharded, full):
        if isinstance(mine, ColumnParallelLinear):
            pairs = [(mine.weight.grad, ref.weight.grad.chunk(world, 0)[rank]),
                     (mine.bias.grad, ref.bias.grad.chunk(world, 0)[rank])]
        elif isinstance(mine, RowParallelLinear):
            pairs = [(mine.weight.grad, ref.weight.grad.chunk(world, 1)[rank]), (mine.bias.grad, ref.bias.grad)]
        elif isinstance(mine, nn.Linear):
            pairs = [(mine.weight.grad, ref.weight.grad), (mine.bias.grad, ref.bias.grad)]
        else:
            continue
        grad_diff = max([grad_diff] + [(a - b).abs().max().item() for a, b in pairs])
    gathered = full_parameters(sharded)
    param_diff = max((a - b.detach()).abs().max().item() for a, b in zip(gathered, full.parameters()))
    kinds = [type(m).__name__ for m in sharded]
    seen = (ref_loss, x, xf.grad, full(x))
    bound = (step_tolerance(full, len(x), *seen), step_tolerance(full, len(x), *seen, dtype=torch.float32))
    return out_diff, grad_in_diff, grad_diff, param_diff, (fwd.calls, bwd.calls), kinds, bound


@pytest.mark.parametrize("style", ["megatron", "naive"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_tensor_parallel_mlp_equals_the_unsharded_one(style, world):
    for out_diff, grad_in_diff, grad_diff, param_diff, calls, kinds, (bound, float32_bound) in run_ranks(
            _tp_vs_full, world, style, timeout=60):
        assert bound < float32_bound  # float64's bound: far tighter than float32 rounding
        assert out_diff <= bound and grad_in_diff <= bound and grad_diff <= bound
        assert param_diff == 0.0  # gathered shards are the seeded full weights, bit for bit
        if style == "megatron":  # one (column, row) block: one all-reduce forward, one backward
            assert kinds == ["ColumnParallelLinear", "ReLU", "RowParallelLinear", "ReLU", "Linear"]
            assert calls == ((1, 1) if world > 1 else (0, 0))
        else:  # two column layers: an all-gather after each forward, an all-reduce of each input grad
            assert kinds == ["ColumnParallelLinear", "ReLU", "ColumnParallelLinear", "ReLU", "Linear"]
            assert calls == ((2, 2) if world > 1 else (0, 0))


def _block_without_all_reduce(rank, world):
    full, mine = _mlp(), _mlp()
    col = ColumnParallelLinear(mine[0], dist.group.WORLD, gather_output=False)
    row = RowParallelLinear(mine[2], dist.group.WORLD)
    x = _x()
    partial = F.linear(F.relu(col(x)), row.weight) + row.bias  # the block with its all-reduce left out
    with_reduce = row(F.relu(col(x)))
    expected = full[2](F.relu(full[0](x)))
    bound = step_tolerance(full[:3], 1, x, full[0](x), expected)  # one row: the terms along one output
    return (partial - expected).abs().max().item(), (with_reduce - expected).abs().max().item(), bound


def test_the_row_parallel_all_reduce_is_what_makes_the_block_right():
    for without, with_reduce, bound in run_ranks(_block_without_all_reduce, 2, timeout=60):
        assert without > 1e-2 and with_reduce <= bound


def test_widths_tp_does_not_divide_and_models_without_linear_layers_are_refused():
    with pytest.raises(ConfigError, match=r"layer 2 has 16 input features, not divisible by `tp` 3"):
        RowParallelLinear(nn.Linear(16, 5), group=_FakeGroup(3), name="2")
    with pytest.raises(ConfigError, match=r"has 10 output features, not divisible by `tp` 4"):
        ColumnParallelLinear(nn.Linear(3, 10), group=_FakeGroup(4))
    with pytest.raises(ConfigError, match="needs a model with Linear layers"):
        apply_tensor_parallel(nn.Sequential(nn.Conv2d(1, 2, 3)), None)
    with pytest.raises(ConfigError, match="`tp_style`"):
        apply_tensor_parallel(_mlp(), None, "diagonal")


class _FakeGroup:
    """Stands in for a process group of ``n`` ranks in the shape check only (raised before any use)."""

    def __init__(self, n):
        self.n = n


@pytest.fixture(autouse=True)
def _fake_group_size(monkeypatch):
    from distlab.parallel.tensor_parallel import layers as tp
    real_size, real_rank = tp.group_size, tp.group_rank
    monkeypatch.setattr(tp, "group_size", lambda g: g.n if isinstance(g, _FakeGroup) else real_size(g))
    monkeypatch.setattr(tp, "group_rank", lambda g: 0 if isinstance(g, _FakeGroup) else real_rank(g))


# ----------------------------------------------------------------------------- training


def _cfg(tp, style="megatron", model="mlp", **kw):
    settings = dict(model=model, mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:96", epochs=2, max_steps=10,
                    global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd", momentum=0.9,
                    weight_decay=1e-4, seed=3, log_every=1, dp_sync="allreduce", progress=False, verbose=False,
                    eval_every_epoch=False, tp=tp, tp_style=style)
    return TrainConfig.from_flags(**{**settings, **kw})


def _train(rank, world, cfg):
    trainer = Trainer(cfg.validate(world), runtime.from_process_group())
    summary = trainer.fit()
    return trainer.full_parameters(), [r["loss"] for r in trainer.history], summary


def _train_each(rank, world, cfgs):
    return [_train(rank, world, cfg) for cfg in cfgs]


@pytest.mark.parametrize("world,cases", [(4, [(2, "megatron"), (2, "naive")]), (2, [(2, "megatron")])])
def test_data_x_tensor_parallel_training_equals_single_process(world, cases):
    cfgs = [_cfg(tp, style) for tp, style in cases]
    per_rank = run_ranks(_train_each, world, cfgs, timeout=300)  # the cases one after another, one start-up
    for i, ((tp, style), cfg) in enumerate(zip(cases, cfgs)):
        ref_params, ref_losses = reference_run(cfg)
        for params, losses, _ in (results[i] for results in per_rank):  # every rank gathers the same full model
            bound = tolerance(cfg)
            assert max((a - b).abs().max().item() for a, b in zip(params, ref_params)) <= bound, (tp, style)
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= bound, (tp, style)
        summary = per_rank[0][i][2]
        assert summary["strategy"]["tp"] == tp and summary["strategy"]["tp_style"] == style


def test_tensor_parallel_applies_to_vgg_classifier():
    model = apply_tensor_parallel(build_model("vgg11", (1, 28, 28), 10), None, "megatron")
    kinds = [type(m).__name__ for m in model.classifier]
    assert kinds == ["Flatten", "ColumnParallelLinear", "ReLU", "RowParallelLinear", "ReLU", "Linear"]


def _mesh_with_wrong_dp(rank, world):
    try:
        build_mesh(2, dp=3)
    except ConfigError as exc:
        return str(exc)


def test_a_mesh_whose_tp_x_dp_is_not_the_world_is_refused():
    for message in run_ranks(_mesh_with_wrong_dp, 4, timeout=60):
        assert message and "`tp` 2 x dp 3 = 6 processes, but the world has 4" in message


def test_tp_flags_are_checked_against_the_world_and_batch():
    with pytest.raises(ConfigError, match="`tp` 3 does not divide the world size 4"):
        _cfg(3).validate(4)
    with pytest.raises(ConfigError, match=r"not divisible by the data-parallel size 2 \(world 4 / `tp` 2\)"):
        _cfg(2, global_batch_size=13).validate(4)
    with pytest.raises(ConfigError, match="`tp_style`"):
        _cfg(2, "diagonal").validate(4)


class _OwnPlan(nn.Module):
    """Not an nn.Sequential: a model whose tensor-parallel plan is its own (what a user's model does)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(12, 32), nn.Linear(32, 5)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

    def tensor_parallel_plan(self, tp, style, sequence_parallel):
        return {"up": "colwise", "down": "rowwise"}


def _own_plan(rank, world):
    from distlab.tools.verify import sum_tolerance
    full, sharded = _OwnPlan(), apply_tensor_parallel(_OwnPlan(), dist.group.WORLD)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(1))
    diff = (sharded(x) - full(x)).abs().max().item()
    bound = sum_tolerance(12 + 32, max(1.0, full.up(x).abs().max().item()))  # the terms along one output
    return type(sharded.up).__name__, type(sharded.down).__name__, diff <= bound


def test_any_model_that_declares_a_plan_is_split_by_it_and_one_without_is_refused_naming_the_method():
    for up, down, close in run_ranks(_own_plan, 2, timeout=60):
        assert (up, down, close) == ("ColumnParallelLinear", "RowParallelLinear", True)
    with pytest.raises(ConfigError, match=r"tensor_parallel_plan\(tp, style, sequence_parallel\).*ResNet18 has none"):
        apply_tensor_parallel(build_model("resnet18", (3, 8, 8), 10), None)
    bad = _OwnPlan()
    bad.tensor_parallel_plan = lambda tp, style, sp: {"up": "diagonal"}
    with pytest.raises(ConfigError, match="unknown style"):
        apply_tensor_parallel(bad, None)
    wrong = _OwnPlan()
    wrong.tensor_parallel_plan = lambda tp, style, sp: {"up": "vocab_embedding"}
    with pytest.raises(ConfigError, match="up is a Linear, but style vocab_embedding applies to an nn.Embedding"):
        apply_tensor_parallel(wrong, None)
