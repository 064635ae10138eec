"""The single-process step path every device shares: where the data lives, loss scaling's unscale,
no host sync per micro-batch, and ``distlab bench overhead`` (plain PyTorch loop vs distlab)."""

import json

import pytest
import torch

from distlab.data import load_dataset
from distlab.data.resident import AUTO_FRACTION, decide
from distlab.errors import ConfigError
from distlab.parallel.precision import LossScaler
from distlab.parallel.verdict import found_non_finite


def test_data_residence_is_decided_once_and_said():
    cuda = torch.device("cuda", 0)
    on, why = decide("auto", cuda, need=10 * 2**20, free=80 * 2**30)
    assert on and "resident on cuda:0" in why and "auto" in why
    on, why = decide("auto", cuda, need=int(AUTO_FRACTION * 8 * 2**30) + 1, free=8 * 2**30)
    assert not on and "over auto's 25%" in why and "data_on_device on forces it" in why
    assert decide("on", cuda, need=7 * 2**30, free=8 * 2**30)[0]  # forced
    assert not decide("off", cuda, need=1, free=8 * 2**30)[0]
    on, why = decide("auto", torch.device("cpu"), need=47 * 2**20)
    assert not on and "host memory" in why
    with pytest.raises(ConfigError, match="this run is on cpu"):
        decide("on", torch.device("cpu"), need=1)
    with pytest.raises(ConfigError, match="choose one of: auto, on, off"):
        decide("sometimes", torch.device("cpu"), need=1)


@pytest.mark.parametrize("name", ["synthetic:3x8x8:4:64", "synthetic-text:2000"])
def test_a_moved_data_set_gives_the_same_batches(name):
    data = load_dataset(name, "train", block_size=8)
    moved = data.to("cpu")  # the same code path a GPU takes: indices follow the data to its device
    idx = [3, 0, 7, 7]  # a list, as the sampler gives
    for a, b in zip(data.batch(torch.tensor(idx)), moved.batch(idx)):
        assert torch.equal(a, b)


def test_fused_unscale_matches_dividing_each_gradient_and_finds_any_inf():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7)),
              torch.nn.Parameter(torch.randn(2))]
    grads = [torch.randn_like(p) * 1024 for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    params[2].grad = None  # no gradient this step: skipped, not an error
    scaler = LossScaler(init_scale=1024.0)
    assert scaler.unscale_(params) is False
    for p, g in zip(params[:2], grads[:2]):
        assert torch.equal(p.grad, g / 1024)  # a power of two: the division is exact
    params[1].grad[3] = float("nan")
    assert scaler.unscale_(params) is True


def test_the_finite_gradient_check_is_exact_and_leaves_gradients_bitwise():
    """Finite gradients whose sum (or sum of squares) would overflow are finite; one nan or one -inf
    anywhere is not; the check changes no gradient bit (the step after it is the step it was)."""
    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    engine = parallelize(net, Strategy(), build_mesh(1))
    params = list(net.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    params[0].grad[:2] = torch.finfo(torch.float32).max  # huge, finite: a sum over them overflows
    params[0].grad[2, :3] = torch.tensor([5e-45, -0.0, -3e38])  # a subnormal, a negative zero
    before = [p.grad.clone() for p in params]
    assert not found_non_finite(engine)
    assert all(torch.equal(p.grad, b) and torch.equal(p.grad.signbit(), b.signbit()) for p, b in zip(params, before))
    params[1].grad = None  # no gradient this step: not an error
    assert not found_non_finite(engine)
    from distlab.parallel.verdict import norms_not_finite  # the GPU's way of reaching the same verdict
    assert float(norms_not_finite([p.grad for p in params if p.grad is not None])) == 0.0
    for bad in (float("nan"), float("-inf")):
        params[3].grad = torch.zeros(4)
        params[3].grad[1] = bad
        assert found_non_finite(engine)
        assert float(norms_not_finite([p.grad for p in params if p.grad is not None])) == 1.0


def _sharded_verdict(rank, world):
    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    engine = parallelize(torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)),
                         Strategy.parse("allreduce+zero=2"), build_mesh(1))
    shards = engine.parameters()  # this rank's flat shards: ranks hold different gradients
    for p in shards:
        p.grad = torch.ones_like(p)
    verdicts = [not found_non_finite(engine)]
    if rank == 1:
        shards[0].grad.view(-1)[0] = float("inf")  # only this rank's shard overflowed
    verdicts.append(not found_non_finite(engine))
    return engine.sharded, verdicts


def test_a_non_finite_shard_on_one_rank_stops_every_rank():
    from distlab.launch.spawn import run_ranks
    assert run_ranks(_sharded_verdict, 2, timeout=60) == [(True, [True, False])] * 2


def _fb(rank, world):
    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
    engine = parallelize(net, Strategy.parse("allreduce+accum=2"), build_mesh(1))
    x, y = torch.randn(8, 1, 4, 4), torch.randint(0, 4, (8,))
    loss = engine.forward_backward(x, y, engine.loss)
    first = torch.nn.functional.cross_entropy(net(x[:4]), y[:4]).item() / 2
    second = torch.nn.functional.cross_entropy(net(x[4:]), y[4:]).item() / 2
    return loss, first + second


def test_forward_backward_leaves_the_loss_on_the_device_summed_as_floats_would_be():
    (loss, floats), = __import__("distlab.launch.spawn", fromlist=["run_ranks"]).run_ranks(_fb, 1)
    assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float64 and loss.dim() == 0
    assert loss.item() == floats  # float64 sum of the float32 micro-batch losses: bitwise what Python adds


def test_bench_overhead_smoke_on_cpu(run_cli, tmp_path):
    proc = run_cli("bench", "overhead", "--workloads", "mlp", "--precisions", "fp32", "--steps", "20", "--runs", "2",
                   "--dataset", "synthetic:1x28x28:10:2048", "--threads", "1", "--out", "o", "--plot", "p",
                   timeout=600)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "o" / "overhead.json").read_text())
    assert [(r["side"], r["round"]) for r in records] == [("plain", 0), ("distlab", 0), ("plain", 1), ("distlab", 1)]
    assert all(r["device"] == "cpu" and r["time_per_step_s_median"] > 0 for r in records)
    assert records[1]["data_on_device"] is False
    assert "distlab / plain" in proc.stdout and (tmp_path / "p" / "overhead.png").stat().st_size > 1000
    from distlab.tools.report import bench_kind
    assert bench_kind(records) == "overhead"
    page = run_cli("report", "o", "-o", "r.html", check=True) and (tmp_path / "r.html").read_text()
    assert "Single-process overhead" in page and "distlab / plain" in page
    proc = run_cli("bench", "overhead", "--precisions", "fp16", "--steps", "20", "--device", "cpu")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def _where_a_block_comes_from(rank, world, tune):
    """Allocate and free a 16 MiB block with libc's malloc; return (what tuning said, bytes mapped
    for it outside the heap, free bytes the heap kept after the free) from glibc's mallinfo2."""
    import ctypes

    from distlab.runtime import tune_host_allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if tune:
        said = tune_host_allocator()
    else:  # the control: glibc's starting threshold (128 KiB), fixed so no earlier free has raised it
        said = None
        libc.mallopt(-3, 128 << 10)
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(16 << 20)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return said, mapped, libc.mallinfo2().fordblks


def test_the_host_allocator_keeps_a_steps_blocks_in_the_heap():
    """glibc maps blocks of 128 KiB and more outside the heap (and unmaps them on free) until its
    dynamic threshold grows: a CPU step's activations are then faulted in anew every step. After
    ``tune_host_allocator`` a 16 MiB block comes from the heap and stays there once freed."""
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt is glibc's (Linux)")
    from distlab.launch.spawn import run_ranks
    tuned, = run_ranks(_where_a_block_comes_from, 1, True)  # each in a fresh process
    if tuned is None or tuned[0] is None:
        pytest.skip("not glibc 2.33+: no mallopt / mallinfo2")
    said, mapped, kept = tuned
    assert "32 MiB" in said and mapped == 0 and kept >= 16 << 20, tuned
    _, mapped, _ = run_ranks(_where_a_block_comes_from, 1, False)[0]
    assert mapped >= 16 << 20  # the control: the way of measuring sees a mapped block
