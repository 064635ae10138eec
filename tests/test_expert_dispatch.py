"""The plain expert dispatch (all-gather in, reduce-scatter out: distlab.parallel.expert_dispatch_plain) as the
oracle of the all-to-all one (distlab.parallel.expert_parallel): the same outputs and gradients, bit for bit."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from distlab.models.moe import MoE

F64 = torch.float64


def _both_dispatches(rank, world, capacity, idle):
    """One MoE layer (6 experts, top 2) sharded both ways over the ranks, fed this rank's batch: outputs, the
    input's and every parameter's gradient from each, the plain one's bytes and what they should be."""
    import torch.distributed as dist

    from distlab.comm import accounting
    from distlab.parallel.expert_parallel import ExpertShard
    torch.manual_seed(3)
    whole = MoE(8, experts=6, top_k=2, capacity_factor=capacity).to(F64)
    if idle:  # every token prefers the first rank's experts: the others get nothing, yet take part throughout
        with torch.no_grad():
            whole.router.weight.zero_()
            whole.router.weight[:6 // world] = torch.rand(6 // world, 8, dtype=F64) + 1
    g = torch.Generator().manual_seed(10 + rank)
    x = (torch.rand if idle else torch.randn)(2, 5 + rank, 8, generator=g, dtype=F64)  # ranks' batches differ
    grad = torch.randn(x.shape, generator=g, dtype=F64)
    results = {}
    for dispatch in ("all_to_all", "all_gather"):
        layer = copy.deepcopy(whole)
        layer.experts = ExpertShard(layer.experts, None, dispatch=dispatch)
        mine = x.clone().requires_grad_()
        accounting.reset()
        out = layer(mine)
        out.backward(grad)
        results[dispatch] = dict(out=out.detach(), grad=mine.grad, sent=accounting.stats().bytes_sent,
                                 params={n: p.grad.clone() for n, p in layer.named_parameters()})
    # per rank, forward and backward: the counts gathered, then every rank's slots (padded to the longest) gathered
    # and the answers reduce-scattered, and the same two for the gradients -- each (world - 1) x longest x 8 floats
    kept = int(layer.routed - layer.dropped)  # this rank's slots
    longest = torch.tensor(kept)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    return results, (world - 1) * 6 * 8 + 4 * (world - 1) * int(longest) * 8 * 8, kept


@pytest.mark.parametrize("world,capacity,idle", [(2, None, False), (3, 0.6, False), (3, None, True)])
def test_the_plain_dispatch_gives_the_all_to_all_its_outputs_and_gradients_bit_for_bit(world, capacity, idle):
    """Dropless, with a capacity (each rank keeping its own number of slots) and with ranks whose experts get
    nothing: the same outputs and gradients as the all-to-all, bit for bit, and the plain one's bytes exactly
    what an all-gather and a reduce-scatter of every rank's slots cost, there and back (world - 1 times the slots'
    bytes each, against the all-to-all's (world - 1) / world)."""
    from distlab.launch.spawn import run_ranks
    runs = run_ranks(_both_dispatches, world, capacity, idle, timeout=120)
    for results, expected, _ in runs:
        fast, plain = results["all_to_all"], results["all_gather"]
        assert torch.equal(fast["out"], plain["out"]) and torch.equal(fast["grad"], plain["grad"])
        assert all(torch.equal(fast["params"][n], plain["params"][n]) for n in fast["params"])
        assert plain["sent"] == expected and fast["sent"] < plain["sent"]
    kept = [k for *_, k in runs]
    assert len(set(kept)) > 1 or not capacity  # the capacity left the ranks unequal numbers of slots
    if idle:
        assert all(r["all_gather"]["grad"].abs().sum() > 0 for r, *_ in runs)


def test_the_cli_trains_with_the_plain_dispatch_the_same_run_and_plan_refuses_it(run_cli, tmp_path):
    """``--ep 2 --ep-dispatch all_gather`` on 2 ranks: the header names the dispatch, every step's loss is the
    all-to-all run's to the last bit, the summary records it; ``plan`` refuses it in one line."""
    common = ["train", "--model", "gpt-moe", "--dataset", "synthetic-text:3000", "--n-layer", "1", "--n-embd", "16",
              "--n-head", "2", "--block-size", "16", "--experts", "4", "--top-k", "2", "--global-batch-size", "8",
              "--max-steps", "3", "--log-every", "1", "--no-progress", "--nproc-per-node", "2", "--ep", "2",
              "--comm-timeout", "60"]
    losses = {}
    for dispatch in ("all_to_all", "all_gather"):
        proc = run_cli(*common, "--ep-dispatch", dispatch, "--out", dispatch, check=True, timeout=240)
        summary = json.loads((tmp_path / dispatch / "summary.json").read_text())
        records = [json.loads(line) for line in (tmp_path / dispatch / "metrics.jsonl").read_text().splitlines()]
        losses[dispatch] = [r["loss"] for r in records if "loss" in r]
        assert summary["strategy"].get("ep_dispatch", "all_to_all") == dispatch
    assert "all-gather and reduce-scatter (the plain dispatch)" in proc.stdout
    assert len(losses["all_gather"]) == 3 and losses["all_gather"] == losses["all_to_all"]
    bad = run_cli("plan", "--model", "gpt-moe", "--experts", "4", "--dp", "2", "--ep", "2", "--ep-dispatch",
                  "all_gather", "--global-batch-size", "8", "--dataset", "synthetic-text")
    assert bad.returncode == 2 and "plan the all-to-all dispatch" in bad.stderr, bad.stderr
