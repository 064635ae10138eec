"""distlab's SyncBatchNorm against torch's BatchNorm on the whole global batch, on real gloo ranks.

Every rank builds the same global batch, runs torch's BatchNorm on all of it as the reference,
and its own slice through SyncBatchNorm. The loss is the sum of the outputs of the first half of
the global batch, so input gradients differ between samples (and between ranks).

Tolerance. Both compute the same formulas over the same values per channel, in another order.
They run in float64 and are compared within ``distlab.tools.verify.sum_tolerance`` for the four
sums over a channel's n values that feed an input gradient (two in forward, two in backward), at
the largest magnitude a term can have: the squared input, times the largest weight, over the
smallest standard deviation (normalising divides by it). That is below 1e-8 here (the differences: ~1e-14)
and machine-independent; a wrong formula (e.g. local instead of global statistics, or a missing
term in the backward) is off by O(0.1-1). Weight and bias gradients are sums over the batch and are
compared relative to their size.
"""

import pytest
import torch
import torch.distributed as dist

from distlab import comm
from distlab.parallel import SyncBatchNorm, convert_sync_batchnorm
from distlab.launch.spawn import run_ranks
from distlab.tools.verify import sum_tolerance

F64 = torch.float64


def _split(n: int, world: int, sizes=None) -> list[int]:
    return list(sizes) if sizes else [n // world + (r < n % world) for r in range(world)]


def _compare(rank, world, shape, sizes=None, momentum=0.1, steps=1, seed=0):
    """Run ``steps`` forward/backward passes; return the worst differences and collective counts."""
    N, C = shape[0], shape[1]
    sizes = _split(N, world, sizes)
    lo = sum(sizes[:rank])
    bn_cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}[len(shape)]
    g = torch.Generator().manual_seed(seed)
    ref = bn_cls(C, momentum=momentum, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(C, generator=g))
        ref.bias.copy_(0.5 * torch.randn(C, generator=g))
    mine = convert_sync_batchnorm(bn_cls(C, momentum=momentum, dtype=F64))
    mine.load_state_dict(ref.state_dict())
    worst = {"out": 0.0, "grad_in": 0.0, "grad_w": 0.0, "grad_b": 0.0, "running": 0.0}
    counts, bound, float32_bound = [], 0.0, 0.0
    for _ in range(steps):
        X = (3 + 2 * torch.randn(*shape, generator=g, dtype=F64)).requires_grad_()  # mean 3, std 2: not standardised
        Y = ref(X)
        Y[: N // 2].sum().backward()
        x = X.detach()[lo:lo + sizes[rank]].clone().requires_grad_()
        with comm.counting() as fwd:
            y = mine(x)
        mask = (torch.arange(lo, lo + sizes[rank]) < N // 2).view(-1, *[1] * (len(shape) - 1))
        with comm.counting() as bwd:
            (y * mask).sum().backward()
        counts.append((fwd.calls, bwd.calls))
        gw, gb = mine.weight.grad.clone(), mine.bias.grad.clone()
        if world > 1:  # parameter gradients are per-rank contributions: their sum is the reference
            dist.all_reduce(gw)
            dist.all_reduce(gb)
        worst["out"] = max(worst["out"], (y.detach() - Y.detach()[lo:lo + sizes[rank]]).abs().max().item()
                           if sizes[rank] else 0.0)
        worst["grad_in"] = max(worst["grad_in"], (x.grad - X.grad[lo:lo + sizes[rank]]).abs().max().item()
                               if sizes[rank] else 0.0)
        worst["grad_w"] = max(worst["grad_w"], ((gw - ref.weight.grad).abs() / (1 + ref.weight.grad.abs())).max().item())
        worst["grad_b"] = max(worst["grad_b"], ((gb - ref.bias.grad).abs() / (1 + ref.bias.grad.abs())).max().item())
        worst["running"] = max(worst["running"], (mine.running_mean - ref.running_mean).abs().max().item(),
                               (mine.running_var - ref.running_var).abs().max().item())
        values = X.numel() // C  # per channel
        std = X.detach().transpose(0, 1).reshape(C, -1).std(dim=1, unbiased=False).min().item()
        scale = max(1.0, X.detach().abs().max().item()) ** 2 * max(1.0, ref.weight.abs().max().item()) / min(1.0, std)
        bound = max(bound, sum_tolerance(4 * values, scale, F64))
        float32_bound = max(float32_bound, sum_tolerance(4 * values, scale, torch.float32))
        for m in (ref, mine):
            m.zero_grad()
    return worst, counts, (bound, float32_bound)


def _grid(rank, world):
    results = {}
    for features in (128, 256, 512, 1024):
        for batch in (32, 64):
            results[(features, batch)] = _compare(rank, world, (batch, features), seed=features + batch)
    return results


@pytest.mark.parametrize("world", [1, 4])
def test_sync_bn_matches_batchnorm1d_on_the_global_batch(world):
    for per_rank in run_ranks(_grid, world, timeout=120):
        for key, (worst, counts, (bound, float32_bound)) in per_rank.items():
            # float64's bound: far tighter than float32 rounding of the same sums
            assert bound < float32_bound and max(worst.values()) <= bound, (key, worst, bound)
            assert counts == [(1, 1)] if world > 1 else counts == [(0, 0)], counts  # one collective each way


def _cases(rank, world):
    return {
        "2d uneven": _compare(rank, world, (7, 5, 4, 4), sizes=[4, 0, 3], steps=2),  # a rank with no samples
        "1d sequence": _compare(rank, world, (9, 6, 5), sizes=[1, 6, 2]),  # (N, C, L) input
        "cumulative": _compare(rank, world, (12, 8), momentum=None, steps=3),  # momentum=None
    }


def test_sync_bn_2d_uneven_batches_an_empty_rank_and_cumulative_momentum():
    for per_rank in run_ranks(_cases, 3, timeout=120):
        for key, (worst, counts, (bound, float32_bound)) in per_rank.items():
            # float64's bound: far tighter than float32 rounding of the same sums
            assert bound < float32_bound and max(worst.values()) <= bound, (key, worst, bound)
            assert all(c == (1, 1) for c in counts), (key, counts)


def _eval_mode(rank, world):
    torch.manual_seed(0)
    bn = SyncBatchNorm(4, dtype=F64)
    bn(torch.randn(6, 4, dtype=F64) * 3 + 1)  # training step: updates the running statistics
    bn.eval()
    x = torch.randn(5, 4, dtype=F64)
    with comm.counting() as c:
        y = bn(x)
    expect = (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    # no sums: a handful of roundings per value (a kernel may compute x * a + b with a = w / std)
    scale = max(1.0, x.abs().max().item(), bn.running_mean.abs().max().item()) / bn.running_var.min().sqrt().item()
    return c.calls, (y - expect).abs().max().item(), sum_tolerance(4, scale, F64)


def test_eval_mode_uses_running_statistics_and_sends_nothing():
    for calls, diff, bound in run_ranks(_eval_mode, 2, timeout=60):
        assert calls == 0 and diff <= bound


def test_convert_sync_batchnorm_keeps_parameters_and_mode():
    from distlab.models import build_model
    net = build_model("vgg11-bn", (3, 32, 32), 10)
    net.eval()
    bns = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    converted = convert_sync_batchnorm(net)
    syncs = [m for m in converted.modules() if isinstance(m, SyncBatchNorm)]
    assert len(syncs) == len(bns) > 0
    assert all(s.weight is b.weight and s.running_mean is b.running_mean and not s.training
               for s, b in zip(syncs, bns))
    ref = build_model("vgg11-bn", (3, 32, 32), 10).eval()
    ref.load_state_dict(converted.state_dict())  # same keys: a converted model loads plain checkpoints
    with torch.no_grad():  # eval on one process: identical to plain BatchNorm
        x = torch.randn(2, 3, 32, 32)
        assert torch.equal(converted(x), ref(x))  # the same F.batch_norm call on the same tensors


def test_too_few_values_is_a_clear_error():
    bn = SyncBatchNorm(3)
    with pytest.raises(ValueError, match="expected more than 1 value per channel"):
        bn(torch.randn(1, 3))
