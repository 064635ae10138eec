"""The plain ZeRO (distlab.parallel.zero.plain) and the tuned one held to each other: the same partition, the same
reduce-scatters of the same elements, so the same parameters and gradients bit for bit -- the plain one is the
oracle of the tuned one's buckets, prefetch and per-module gathers. Then the plain one through the commands a
user types: verify, a snapshot it writes resumed by the tuned one (test_reshard.py), and what it refuses."""

import pytest
import torch
import torch.nn.functional as F

from distlab.launch.spawn import run_ranks
from distlab.models import build_model
from distlab.parallel.state_bytes import storage_bytes
from distlab.parallel.zero import Zero
from distlab.parallel.zero.plain import PlainZero

WORLD, BATCH = 3, 12  # 3 ranks: no parameter of the MLP divides evenly, every shard padded


def _train(rank, world, stage, plain, frozen):
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 5, widths=(33, 17))
    if frozen:  # a frozen layer (a base under adapters) is held whole by the plain one, sharded by the tuned one
        model.net[1].weight.requires_grad_(False)
    zero = PlainZero(model, stage) if plain else Zero(model, stage)
    opt = torch.optim.Adam(zero.optimizer_parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    grads, between = [], None
    for _ in range(3):
        x, y = torch.randn(BATCH, 1, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g)
        mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        F.cross_entropy(zero(x[mine]), y[mine]).backward()
        zero.sync_gradients()
        grads.append(zero.full_gradients())
        opt.step()
        opt.zero_grad()
        zero.after_step()
        between = storage_bytes(p for p in model.parameters() if p.requires_grad)  # the full parameters held
    with zero.gathered() as m:
        return [p.detach().clone() for p in m.parameters()], grads, between


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_plain_zero_and_the_tuned_one_train_the_same_model_bit_for_bit(stage):
    frozen = stage == 3
    plain, grads_plain, held = run_ranks(_train, WORLD, stage, True, frozen, timeout=180)[0]
    tuned, grads_tuned, _ = run_ranks(_train, WORLD, stage, False, frozen, timeout=180)[0]
    assert all(torch.equal(a, b) for a, b in zip(plain, tuned))
    for a, b in zip(grads_plain, grads_tuned):
        assert a.keys() <= b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    sizes = [p.numel() for p in build_model("mlp", (1, 8, 8), 5, widths=(33, 17)).parameters()]
    if frozen:
        sizes.remove(33 * 17)
    # between steps stages 1-2 hold every parameter whole (in its buffer padded to a multiple of 3), stage 3 its
    # shards alone (each parameter a zero of its shape: one element)
    padded = sum(-(-k // WORLD) * WORLD * 4 for k in sizes)
    assert held == (padded if stage < 3 else 4 * len(sizes)), (stage, held, padded)


def test_verify_passes_the_plain_zero_on_every_stage_with_a_pipeline_and_the_plain_bucketed_sync(run_cli):
    proc = run_cli("verify", "--nproc", "4", "--steps", "2", "--strategy", "zero=1+zero_impl=plain",
                   "--strategy", "zero=3+zero_impl=plain+accum=2", "--strategy", "zero=2+zero_impl=plain+pp=2+mb=2+gpt",
                   "--strategy", "bucketed_plain+accum=2", check=True)
    rows = [line for line in proc.stdout.splitlines() if "plain" in line and "PASS" in line]
    assert len(rows) == 4, proc.stdout


def test_the_plain_zero_refuses_what_it_leaves_to_the_tuned_one_in_one_line(refused_here):
    for flags, said in [(["--zero-impl", "plain"], "give a stage"),
                        (["--zero", "3", "--zero-impl", "plain", "--tp", "2"], "leaves tp to the tuned one"),
                        (["--zero", "2", "--zero-impl", "fast"], "choose one of: tuned, plain")]:
        err = refused_here("train", "--nproc-per-node", "2", *flags).stderr
        assert said in err and len(err.strip().splitlines()) == 1, err
    err = refused_here("plan", "--dp", "2", "--zero", "3", "--zero-impl", "plain").stderr
    assert "plan the tuned ZeRO" in err, err
    err = refused_here("plan", "--model", "gpt", "--dataset", "synthetic-text", "--cp", "2", "--cp-style",
                       "ring_plain").stderr
    assert "plan the tuned ring (--cp-style ring)" in err, err
