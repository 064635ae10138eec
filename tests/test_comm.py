"""distlab.comm against references built from every rank's input.

Inputs are generated from (seed, rank) so each rank can rebuild all ranks' inputs and compare
its result locally with a float64 reference. Tolerance for sum/avg: any summation order of n
terms is within (n-1) * eps * sum|x_i| of the exact sum (eps of the dtype), so we allow
(n+1) * eps * sum|x_i| (+1 eps for avg's division); product likewise relative to |product|;
max/min and integer results must be exact.
"""

import os

import pytest
import torch
import torch.distributed as dist

from distlab import comm
from distlab.errors import ConfigError
from distlab.launch.spawn import RankFailure, run_ranks

ALGOS = ["native", "ring", "ring_plain", "butterfly", "butterfly_plain", "direct", "gather_scatter"]
SIZES = [0, 1, 7, 1000, 1001]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]


def _input(rank, numel, dtype, op, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + numel)
    if dtype.is_floating_point:
        x = torch.rand(numel, generator=g, dtype=torch.float64)
        x = 0.5 + x if op == "product" else 2 * x - 1
    else:
        x = torch.randint(-3, 4, (numel,), generator=g, dtype=torch.int64)
    return x.to(dtype)


def _reference(inputs, op):
    xs = torch.stack([x.double() for x in inputs])
    if op in ("sum", "avg"):
        ref = xs.sum(0) / (len(inputs) if op == "avg" else 1)
        scale = xs.abs().sum(0) / (len(inputs) if op == "avg" else 1)
    elif op == "product":
        ref = xs.prod(0)
        scale = ref.abs() * len(inputs)
    else:
        ref = xs.max(0).values if op == "max" else xs.min(0).values
        scale = torch.zeros_like(ref)
    return ref, scale


def _close(got, inputs, op):
    ref, scale = _reference(inputs, op)
    dtype = inputs[0].dtype
    if not dtype.is_floating_point:
        return torch.equal(got.double(), ref)
    eps = torch.finfo(dtype).eps
    bound = (len(inputs) + 2) * eps * scale + eps * ref.abs()
    return bool(((got.double() - ref).abs() <= bound).all())


def _grid(rank, world):
    failures = []
    for algo in ALGOS:
        for dtype in FLOATS + INTS:
            ops = ["sum", "avg", "max", "min", "product"] if dtype.is_floating_point else ["sum", "max", "min", "product"]
            for op in ops:
                for numel in SIZES:
                    inputs = [_input(r, numel, dtype, op) for r in range(world)]
                    t = inputs[rank].clone()
                    comm.all_reduce(t, op=op, algorithm=algo)
                    if t.dtype != dtype or t.shape != (numel,) or not _close(t, inputs, op):
                        failures.append(f"all_reduce {algo} {op} {dtype} n={numel}")
            # reduce-scatter and all-gather: k elements per rank, including k = 0
            for k in (0, 1, 250):
                inputs = [_input(r, world * k, dtype, "sum", seed=1) for r in range(world)]
                out = torch.empty(k, dtype=dtype)
                comm.reduce_scatter(out, inputs[rank].clone(), op="sum", algorithm=algo)
                full, _ = _reference(inputs, "sum")
                if not _close(out, [x[rank * k:(rank + 1) * k] for x in inputs], "sum"):
                    failures.append(f"reduce_scatter {algo} {dtype} k={k}")
                mine = _input(rank, k, dtype, "sum", seed=2)
                gathered = torch.empty(world * k, dtype=dtype)
                comm.all_gather(gathered, mine, algorithm=algo)
                expect = torch.cat([_input(r, k, dtype, "sum", seed=2) for r in range(world)])
                if not torch.equal(gathered, expect):
                    failures.append(f"all_gather {algo} {dtype} k={k}")
            for src in {0, world - 1}:
                b = _input(rank, 1001, dtype, "sum", seed=3)
                comm.broadcast(b, src=src, algorithm=algo)
                if not torch.equal(b, _input(src, 1001, dtype, "sum", seed=3)):
                    failures.append(f"broadcast {algo} {dtype} src={src}")
    # the plain butterfly is the tuned one's oracle: the same exchanges, the same sums bit for bit
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ("sum", "avg", "max") if dtype.is_floating_point else ("sum", "product"):
            for numel in SIZES:
                got = {}
                for algo in ("butterfly", "butterfly_plain"):
                    got[algo] = _input(rank, numel, dtype, op).clone()
                    comm.all_reduce(got[algo], op=op, algorithm=algo)
                if not torch.equal(got["butterfly"], got["butterfly_plain"]):
                    failures.append(f"butterfly {op} {dtype} n={numel}: not the plain butterfly's")
    # non-contiguous input (a transposed view): reduced in place, layout kept
    for algo in ALGOS:
        base = [_input(r, 2 * 301, torch.float32, "sum").view(2, 301) for r in range(world)]
        t = base[rank].clone().t()  # (301, 2), not contiguous
        comm.all_reduce(t, algorithm=algo)
        if t.is_contiguous() or not _close(t.t().reshape(-1), [b.reshape(-1) for b in base], "sum"):
            failures.append(f"non-contiguous {algo}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_every_algorithm_op_size_and_dtype_matches_the_reference(world):
    results = run_ranks(_grid, world, timeout=600)
    failures = sorted({f for r in results for f in r})
    assert not failures, f"{len(failures)} cases wrong, e.g. {failures[:10]}"


def _subgroups(rank, world):
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    group = evens if rank % 2 == 0 else odds
    members = [0, 2] if rank % 2 == 0 else [1, 3]
    out = {}
    for algo in ALGOS:
        t = _input(rank, 1001, torch.float64, "sum")
        comm.all_reduce(t, algorithm=algo, group=group)
        out[algo] = _close(t, [_input(m, 1001, torch.float64, "sum") for m in members], "sum")
    return out


def test_subgroups_reduce_only_their_members():
    for result in run_ranks(_subgroups, 4, timeout=120):
        assert all(result.values()), result


def _bytes(rank, world, numel):
    sent = {}
    for algo in ALGOS:
        with comm.counting() as c:
            comm.all_reduce(torch.ones(numel), algorithm=algo)
        sent[algo] = (c.bytes_sent, c.calls)
    return sent


@pytest.mark.parametrize("world", [4, 5])
def test_bytes_sent_match_the_textbook_volumes(world):
    numel = 1000  # divisible by 4 and 5, so every chunk is the same size
    S = 4 * numel
    results = run_ranks(_bytes, world, numel, timeout=120)
    for rank, sent in enumerate(results):
        assert all(calls == 1 for _, calls in sent.values())
        assert sent["ring"][0] == sent["ring_plain"][0] == sent["direct"][0] == 2 * (world - 1) * S // world
        assert sent["native"][0] == 2 * (world - 1) * S // world  # analytic
        assert sent["gather_scatter"][0] == ((world - 1) * S if rank == 0 else S)
        assert sent["butterfly_plain"][0] == sent["butterfly"][0]  # (its all-reduce: the same messages)
        if world == 4:
            assert sent["butterfly"][0] == 2 * 3 * S // 4
        else:  # p = 4, rem = 1: rank 0 folds into rank 1 (S), rank 1 unfolds back (S more)
            expected = {0: S, 1: 2 * 3 * S // 4 + S}.get(rank, 2 * 3 * S // 4)
            assert sent["butterfly"][0] == expected


def _peer_dies(rank, world, algo):
    if rank == world - 1:
        os._exit(3)
    t = torch.ones(10_000)
    comm.all_reduce(t, algorithm=algo)
    return "no error"


@pytest.mark.parametrize("algo", ["ring", "butterfly", "direct", "gather_scatter", "native"])
def test_a_killed_peer_makes_the_others_raise_within_the_timeout(algo):
    with pytest.raises(RankFailure) as err:
        run_ranks(_peer_dies, 3, algo, timeout=90, pg_timeout=2)
    text = str(err.value)
    assert "still running" not in text  # no hang: every survivor raised
    assert "rank 0 failed" in text and "rank 1 failed" in text and "exited with code 3" in text


def _mismatched(rank, world):
    comm.all_reduce(torch.ones(1000 + rank), algorithm="ring")


def test_different_sizes_on_different_ranks_raise_rather_than_hang():
    with pytest.raises(RankFailure) as err:
        run_ranks(_mismatched, 2, timeout=90, pg_timeout=2)
    assert "still running" not in str(err.value)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown collective algorithm 'tree'"):
        comm.all_reduce(torch.ones(3), algorithm="tree")
    with pytest.raises(ConfigError, match="unknown reduction op 'mean'"):
        comm.all_reduce(torch.ones(3), op="mean")
    with pytest.raises(ConfigError, match="op 'avg' on torch.int64"):
        comm.all_reduce(torch.ones(3, dtype=torch.int64), op="avg")


def _segmented(rank, world):
    """The ring's streamed pipeline with many segments per chunk and a small receive window, so
    segment bookkeeping, scratch-slot reuse and the early all-gather receives are all exercised -- against
    the reference, and bit for bit against the plain ring (comm.ring_plain: the same schedule, unstreamed)."""
    from distlab.comm import p2p, ring
    ring.SEGMENT_BYTES, ring.WINDOW = 12, 2  # 3 float32 / 1 float64 element(s) per segment
    failures = []
    for dtype in (torch.float32, torch.int64):
        for op in ("sum", "max"):
            for numel in (7, 1001):
                inputs = [_input(r, numel, dtype, op) for r in range(world)]
                t = inputs[rank].clone()
                comm.all_reduce(t, op=op, algorithm="ring")
                if not _close(t, inputs, op):
                    failures.append(f"all_reduce {op} {dtype} n={numel}")
                plain = inputs[rank].clone()  # the oracle: the ring as the algorithm reads, the same sums bit for bit
                comm.all_reduce(plain, op=op, algorithm="ring_plain")
                if not torch.equal(t, plain):
                    failures.append(f"all_reduce {op} {dtype} n={numel}: not the plain ring's")
        k = 250
        inputs = [_input(r, world * k, dtype, "sum", seed=1) for r in range(world)]
        out = torch.empty(k, dtype=dtype)
        comm.reduce_scatter(out, inputs[rank].clone(), algorithm="ring")
        if not _close(out, [x[rank * k:(rank + 1) * k] for x in inputs], "sum"):
            failures.append(f"reduce_scatter {dtype}")
        gathered = torch.empty(world * k, dtype=dtype)
        comm.all_gather(gathered, _input(rank, k, dtype, "sum", seed=2), algorithm="ring")
        if not torch.equal(gathered, torch.cat([_input(r, k, dtype, "sum", seed=2) for r in range(world)])):
            failures.append(f"all_gather {dtype}")
    # Which connection a ring neighbour uses: the partner only for two ranks (where the pair sends
    # both ways at once); from three on, the group's own connection carries one direction anyway.
    wrap = p2p.Peer(None, (rank - 1) % world, world == 2)  # rank 0 receives the wrap-around pair
    own = wrap._recv.__self__ is dist.group.WORLD
    return failures, p2p._partner(None) is not None, own


@pytest.mark.parametrize("world,duplex", [(2, "1"), (3, "1"), (4, "1"), (2, "0")])
def test_ring_pipeline_with_many_segments_and_both_channel_layouts(world, duplex):
    results = run_ranks(_segmented, world, timeout=300, envs=[{"DISTLAB_P2P_DUPLEX": duplex}] * world)
    failures = sorted({f for r, _, _ in results for f in r})
    assert not failures, failures
    assert all(has_partner == (duplex == "1") for _, has_partner, _ in results)
    own_connection = results[0][2]  # rank 0's receive from rank world-1
    assert own_connection == (world > 2 or duplex == "0")


def _ops_as_torch_names_and_per_algorithm(rank, world):
    from distlab.comm import ring
    out = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, "AVG", "Sum"):
        t = torch.tensor([float(rank + 1), 2.0 * rank])
        comm.all_reduce(t, op=op, algorithm="ring")
        out[str(op)] = t.tolist()
    direct = torch.tensor([float(rank + 1)])
    ring.all_reduce(direct, "avg", None, rank, world)  # an algorithm module on its own: avg is the mean too
    out["ring-module-avg"] = direct.tolist()
    return out


def test_ops_accept_reduce_op_and_any_case_and_avg_means_mean_everywhere():
    for out in run_ranks(_ops_as_torch_names_and_per_algorithm, 3, timeout=60):
        assert out[str(dist.ReduceOp.SUM)] == [6.0, 6.0] and out[str(dist.ReduceOp.MAX)] == [3.0, 4.0]
        assert out["AVG"] == [2.0, 2.0] and out["Sum"] == [6.0, 6.0]
        assert out["ring-module-avg"] == [2.0]


def _partners_released(rank, world):
    import atexit

    from distlab import runtime
    from distlab.comm import p2p
    comm.all_reduce(torch.ones(8), algorithm="ring")  # a ring of two: the pair gets a duplex partner
    had_partner = p2p._partner(None) is not None
    runtime.shutdown()
    at_exit = atexit.unregister(p2p.release) is None and p2p._RELEASE_AT_EXIT
    return had_partner, len(p2p._LINKS), at_exit


def test_shutdown_releases_the_duplex_partners_torch_does_not_know():
    """torch's destroy_process_group leaves the partner groups alone; left to the interpreter's own
    teardown, gloo can abort a process that had finished its work. runtime.shutdown releases them,
    and an atexit handler does for a script that destroys the group itself."""
    for had_partner, links_left, at_exit in run_ranks(_partners_released, 2, timeout=120):
        assert had_partner and links_left == 0 and at_exit
