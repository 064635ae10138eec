"""Mixture of experts (distlab.models.moe) and expert parallel (distlab.parallel.expert_parallel)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from distlab.models.aux_loss import step_share
from distlab.models.moe import MoE
from distlab.tools.verify import sum_tolerance
from tests.conftest import patience

F64 = torch.float64


def test_the_balance_loss_reaches_the_router_as_if_it_were_added_to_the_loss():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=F64)
    layer = MoE(8, experts=4, top_k=2, aux_coef=0.1).to(F64)
    plain = copy.deepcopy(layer)
    plain.aux_coef = 0.0
    layer(x).sum().backward()
    # by hand: the same layer without the injected gradient, plus 0.1 x the balance loss in the loss
    probs = plain.router(x.reshape(-1, 8)).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    (plain(x).sum() + 0.1 * plain._balance_loss(probs.view(3, 5, 4), chosen.view(3, 5, 2))).backward()
    # float64, the same sums in another order: 15 tokens x 8 features x 4 experts feed a gradient entry
    bound = sum_tolerance(15 * 8 * 4, max(1.0, *(p.grad.abs().max().item() for p in plain.parameters())), F64)
    for a, b in zip(layer.parameters(), plain.parameters()):
        assert (a.grad - b.grad).abs().max() <= bound
    # half the step's share (two micro-batches): half the balance loss's gradient
    half, none = copy.deepcopy(layer), copy.deepcopy(layer)
    none.aux_coef = 0.0
    for m, share in ((half, 0.5), (none, 1.0)):
        m.zero_grad()
        with step_share(share):
            m(x).sum().backward()
    full = layer.router.weight.grad - none.router.weight.grad
    assert full.abs().max() > 0
    assert ((half.router.weight.grad - none.router.weight.grad) - 0.5 * full).abs().max() <= 2 * bound
    # a router that cannot tell experts apart balances perfectly: the loss is exactly 1
    flat = MoE(8, experts=4, top_k=2)
    torch.nn.init.zeros_(flat.router.weight)
    flat(x.float())
    assert flat.last_aux.item() == pytest.approx(1.0, abs=sum_tolerance(4 * 15, 1.0))  # E * sum f P over 15 tokens
    assert flat.routing_statistics()["routed"] == 3 * 5 * 2


def test_dropless_routing_is_per_token_and_a_capacity_drops_the_latest_slots():
    torch.manual_seed(1)
    layer = MoE(8, experts=4, top_k=2).to(F64).eval()
    x = torch.randn(4, 5, 8, dtype=F64)
    whole = layer(x)
    apart = torch.cat([layer(x[i:i + 1]) for i in range(4)])
    assert (whole - apart).abs().max() <= sum_tolerance(8 * 32, 1.0, F64)
    capped = copy.deepcopy(layer).train()
    capped.capacity_factor = 0.5
    out = capped(x)
    chosen = layer.router(x.reshape(-1, 8)).softmax(-1).topk(2, dim=-1).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=4)
    cap = capped.capacity(len(chosen))
    assert cap == 5 and capped.routing_statistics()["dropped"] == int((counts - cap).clamp(min=0).sum()) > 0
    # the first token's slots come first at every expert: kept; a token whose slots all came late: zero
    assert (out.reshape(-1, 8)[0] - whole.reshape(-1, 8)[0]).abs().max() <= sum_tolerance(8 * 32, 1.0, F64)
    rank_at = {}
    for slot, e in enumerate(chosen.tolist()):
        rank_at[slot] = sum(1 for s in range(slot) if chosen[s] == e)
    dropped = [t for t in range(20) if all(rank_at[2 * t + j] >= cap for j in range(2))]
    assert dropped and all(out.reshape(-1, 8)[t].abs().max() == 0 for t in dropped)


def test_a_full_expert_keeps_its_most_probable_slots_under_the_probs_policy():
    torch.manual_seed(1)
    x = torch.randn(4, 5, 8, dtype=F64)
    by_position = MoE(8, experts=4, top_k=2, capacity_factor=0.5).to(F64)
    by_prob = copy.deepcopy(by_position)
    by_prob.drop_policy = "probs"
    with pytest.raises(ValueError, match="drop_policy must be one of position, probs"):
        MoE(8, experts=4, drop_policy="random")
    probs = by_prob.router(x.reshape(-1, 8)).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices                                     # (tokens, k)
    p_slot, e_slot = probs.gather(1, chosen).reshape(-1), chosen.reshape(-1)  # each slot's expert and probability
    cap = by_prob.capacity(len(e_slot))
    out_prob, out_pos = by_prob(x).reshape(-1, 8), by_position(x).reshape(-1, 8)
    assert by_prob.dropped == by_position.dropped > 0  # the same number dropped, others chosen
    kept = torch.zeros(len(e_slot), dtype=torch.bool)
    for e in range(4):
        slots = (e_slot == e).nonzero().flatten()
        best = slots[torch.argsort(-p_slot[slots], stable=True)][:cap]
        kept[best] = True
        assert len(best) == min(cap, len(slots))
        if len(slots) > cap:  # every slot kept at this expert is at least as probable as every one dropped
            assert p_slot[best].min() >= p_slot[slots[~kept[slots]]].max()
    # a token whose slots were all dropped gets nothing; one whose slots were all kept its whole output
    whole = MoE(8, experts=4, top_k=2).to(F64)
    whole.load_state_dict(by_prob.state_dict())
    full = whole(x).reshape(-1, 8)
    both, neither = kept.view(-1, 2).all(1), (~kept.view(-1, 2)).all(1)
    assert both.any() and neither.any()
    assert (out_prob[both] - full[both]).abs().max() <= sum_tolerance(8 * 32, 1.0, F64)
    assert out_prob[neither].abs().max() == 0
    assert not torch.equal(out_prob, out_pos)  # the policies chose differently here


def test_a_drop_policy_without_a_capacity_or_routing_settings_without_experts_are_refused(refused_here):
    proc = refused_here("train", "--model", "gpt-moe", "--dataset", "synthetic-text:2000", "--drop-policy", "probs")
    assert "--drop-policy probs" in proc.stderr and "--capacity-factor" in proc.stderr
    proc = refused_here("train", "--model", "gpt-moe", "--dataset", "synthetic-text:2000", "--drop-policy", "random",
                        "--capacity-factor", "1")
    assert "--drop-policy" in proc.stderr and "probs" in proc.stderr
    for flags in (("--capacity-factor", "1.25"), ("--drop-policy", "probs")):
        proc = refused_here("train", "--model", "mlp", "--dataset", "synthetic:1x8x8:4:64", *flags)
        assert f"{flags[0]} is for a mixture of experts' routing" in proc.stderr and "model mlp" in proc.stderr


def _expert_layer(rank, world):
    import torch.distributed as dist

    from distlab.comm import accounting
    from distlab.parallel.expert_parallel import ExpertShard, exchange_bytes
    torch.manual_seed(3)
    ref = MoE(8, experts=6, top_k=2, aux_coef=0.1).to(F64)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(world, 2, 5, 8, generator=g, dtype=F64)  # each rank's own batch
    grad = torch.randn(world, 2, 5, 8, generator=g, dtype=F64)
    layer = copy.deepcopy(ref)
    loads, xs = [], x.clone().requires_grad_()
    for r in range(world):  # the whole layer on every rank's batch, one forward each
        ref.reset_statistics()
        ref(xs[r]).backward(grad[r])
        loads.append(ref.routing_statistics()["load"])
        if r == rank:
            mine_ref = ref(x[r]).detach()
    layer.experts = ExpertShard(layer.experts, None)
    accounting.reset()
    mine = x[rank].clone().requires_grad_()
    out = layer(mine)
    out.backward(grad[rank])
    sent = accounting.stats().bytes_sent
    local = 6 // world
    ours = range(rank * local, (rank + 1) * local)
    routed_out = sum(v for e, v in enumerate(loads[rank]) if e not in ours)
    routed_in = sum(loads[s][e] for s in range(world) if s != rank for e in ours)
    router = layer.router.weight.grad.clone()
    dist.all_reduce(router)  # the router is replicated: its gradient sums over the ranks' tokens
    diffs = [(out - mine_ref).abs().max().item(), (router - ref.router.weight.grad).abs().max().item(),
             (mine.grad - xs.grad[rank]).abs().max().item()]
    for name, p in layer.experts.named_parameters():
        whole = getattr(ref.experts, name).grad[rank * local:(rank + 1) * local]
        diffs.append((p.grad - whole).abs().max().item())
    full = layer.experts.full_parameters()
    gathered = all(torch.equal(a, b.detach()) for a, b in zip(full, ref.experts.parameters()))
    return diffs, sent, exchange_bytes(routed_out, routed_in, 8, world, local, itemsize=8), gathered


@pytest.mark.parametrize("world", [2, 3])
def test_experts_sharded_over_ranks_compute_what_the_whole_layer_does_and_count_their_bytes(world):
    from distlab.launch.spawn import run_ranks
    results = run_ranks(_expert_layer, world, timeout=120)
    bound = sum_tolerance(8 * 32 * 2 * world, 10.0, F64)  # float64, sums of a few hundred terms in another order
    for diffs, sent, volume, gathered in results:
        assert max(diffs) <= bound, (diffs, bound)
        assert sent == volume and gathered


def test_training_with_experts_sharded_equals_one_process():
    """On 4 ranks: the MoE transformer (8 experts, top 2) with ep 2 and 4, with DDP, with tensor
    parallel, a pipeline and context parallel, and under sequence parallel (each tensor-parallel rank
    routing its own positions) -- each equal to one process (verify's float32 bound, SGD)."""
    from distlab.tools.verify import parse_strategy, verify
    cases = ["bucketed+ep=4+gpt-moe", "ddp+ep=2+gpt-moe", "allreduce+tp=2+ep=2+gpt-moe",
             "bucketed+ep=2+pp=2+mb=2+gpt-moe", "bucketed+cp=2+ep=2+gpt-moe", "allreduce+tp=2+sp+gpt-moe"]
    records = verify([parse_strategy(c) for c in cases], 4, steps=3, timeout=300)
    for r in records:
        assert r["passed"] and r["max_abs_param_diff"] <= r["tolerance"], r


def test_the_cli_trains_experts_in_parallel_reports_their_load_and_resumes_on_another_layout(run_cli, tmp_path):
    """ep 2 on 2 ranks: the header shows the groups, the summary every expert's load (all the routed
    slots); its step-3 snapshot resumed by one process (the experts gathered whole), and by ZeRO-3 beside the
    experts (the dense part cut into shards, the experts held whole), ends within verify's float32 bound of the
    uninterrupted run -- the ZeRO run's own snapshots put back together by export."""
    import shutil

    from distlab.tools.verify import sgd_tolerance
    common = ["train", "--model", "gpt-moe", "--dataset", "synthetic-text:6000", "--n-layer", "2", "--n-embd", "16",
              "--n-head", "2", "--block-size", "16", "--experts", "4", "--top-k", "2", "--global-batch-size", "8",
              "--max-steps", "6", "--lr-schedule", "constant", "--no-progress", "--snapshot-every", "3",
              "--keep-snapshots", "5", "--eval-batch-size", "18", "--comm-timeout", "60"]
    # 37 test windows over 2 ranks, 18 a batch: one rank evaluates 2 batches, the other 1 and an empty one
    # (every forward exchanges tokens between them)
    proc = run_cli(*common, "--nproc-per-node", "2", "--ep", "2", "--snapshot-dir", "s", "--out", "ep2", check=True,
                   timeout=240)
    assert "dp 2 (ep 2): DP groups [0, 1]; EP groups [0, 1]" in proc.stdout and "expert load" in proc.stdout
    summary = json.loads((tmp_path / "ep2" / "summary.json").read_text())
    experts = summary["experts"]
    assert summary["strategy"]["ep"] == 2 and summary["mesh"]["ep"] == 2
    assert sum(experts["load"]) == experts["routed"] == 6 * 8 * 16 * 2 * 2  # steps x batch x tokens x top-k x layers
    assert experts["dropped"] == 0 and sorted(experts["layers"]) == ["1.mlp", "2.mlp"]
    (tmp_path / "one").mkdir()
    shutil.copytree(tmp_path / "s" / "step-00000003", tmp_path / "one" / "step-00000003")
    run_cli(*common, "--snapshot-dir", "one", "--resume", "auto", "--out", "one-out", check=True, timeout=240)
    (tmp_path / "zero").mkdir()
    shutil.copytree(tmp_path / "s" / "step-00000003", tmp_path / "zero" / "step-00000003")
    run_cli(*common, "--nproc-per-node", "2", "--ep", "2", "--zero", "3", "--snapshot-dir", "zero", "--resume", "auto",
            "--out", "zero-out", check=True, timeout=patience(240))
    models = {}
    for d in ("s", "one", "zero"):
        run_cli("export", f"{d}/step-00000006", "-o", f"{d}.pt", check=True)
        models[d] = torch.load(tmp_path / f"{d}.pt", weights_only=True)
    assert models["s"]["1.mlp.experts.up_weight"].shape[0] == 4
    for d in ("one", "zero"):
        diff = max((models["s"][k] - models[d][k]).abs().max().item() for k in models["s"])
        assert diff <= sgd_tolerance(6, 0.05, 8 * 16, 0.9), (d, diff)
    bad = run_cli(*common, "--nproc-per-node", "2", "--ep", "3", "--snapshot-dir", "bad-s", "--out", "bad")
    assert bad.returncode == 2 and "--ep 3 does not divide the data-parallel size 2" in bad.stderr, bad.stderr
    from distlab.errors import ConfigError
    from distlab.train import TrainConfig
    moe = dict(model="gpt-moe", dataset="synthetic-text:6000", n_layer=2, n_embd=16, n_head=2, block_size=16,
               experts=4, global_batch_size=8)
    for changes, message in (({"model": "gpt", "experts": None}, "expert_parallel_plan"),
                             ({"experts": 3}, "choose an `ep` that divides 3")):
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_flags(**{**moe, "ep": 2, **changes}).validate(2)


def test_fault_drills_and_strategies_name_expert_parallel(tmp_path):
    from distlab.parallel import Strategy
    from distlab.parallel.mesh import layout
    from distlab.tools.faults import _Job
    from distlab.tools.verify import parse_strategy
    case = parse_strategy("bucketed+ep=2+gpt-moe")
    assert case.model == "gpt-moe" and case.strategy == Strategy(ep=2) and str(case.strategy) == "bucketed+ep=2"
    command = _Job(case, 2, 8, tmp_path, 60).command()
    assert command[command.index("--model") + 1] == "gpt-moe" and "--ep" in command
    assert "ep" not in Strategy().to_dict() and Strategy.from_dict(Strategy(ep=2).to_dict()) == Strategy(ep=2)
    groups = layout(8, tp=1, pp=2, ep=2)  # dp 4 per stage: EP pairs, expert gradients over the same shard's ranks
    assert groups.ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups.expert_data_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _idle_experts(rank, world):
    """Every token prefers the first rank's experts: the second rank's receive nothing, yet must take
    part in every exchange, backward included, step after step."""
    from distlab.parallel.expert_parallel import ExpertShard
    torch.manual_seed(4)
    layer = MoE(8, experts=6, top_k=2).to(F64)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:3] = torch.rand(3, 8, dtype=F64) + 1  # positive inputs: experts 0-2 always win
    layer.experts = ExpertShard(layer.experts, None)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.rand(2, 5, 8, generator=g, dtype=F64).requires_grad_()
        layer(x).sum().backward()
    return layer.routing_statistics()["load"], x.grad.abs().sum().item()


def test_a_rank_whose_experts_receive_no_tokens_still_exchanges_their_gradients():
    from distlab.launch.spawn import run_ranks
    (load, grad), _ = run_ranks(_idle_experts, 2, timeout=60)
    assert sum(load[3:]) == 0 and sum(load) == 3 * 2 * 5 * 2 and grad > 0


def test_the_plan_shards_the_experts_state_and_counts_the_all_to_all_bytes():
    from distlab.errors import ConfigError
    from distlab.parallel import Strategy
    from distlab.plan.trace import trace
    from distlab.plan.machine import Link
    from distlab.plan.predict import Layout, predict
    t = trace("gpt-moe", (16,), 256, n_layer=2, n_head=4, n_embd=32, experts=8, top_k=2)
    expert = sum(n for name, n in zip(t.names, t.numels) if name in t.expert_names)
    assert len(t.expert_names) == 8 and expert == 2 * 8 * (32 * 128 + 128 + 128 * 32 + 32)
    dp = predict(t, Layout(dp=4, global_batch=16), Link(), None)
    ep = predict(t, Layout(dp=4, strategy=Strategy(ep=4), global_batch=16), Link(), None)
    assert dp["parameter_bytes_per_rank"] - ep["parameter_bytes_per_rank"] == 4 * (expert - expert // 4)
    # 4 samples x 16 tokens x top-2 slots x width 32 floats per MoE layer, 2 layers; 3/4 of them leave, out and
    # back, forward and backward; plus each layer's per-expert counts (3 peers x 2 local experts x 8 bytes)
    slots = 4 * 16 * 2 * 32 * 4 * 2
    assert ep["expert_parallel"]["bytes_per_step_per_rank"] == 4 * 3 / 4 * slots + 2 * 3 * 2 * 8
    with pytest.raises(ConfigError, match="declares none"):
        predict(trace("gpt", (16,), 256, n_embd=32), Layout(dp=4, strategy=Strategy(ep=4), global_batch=16), Link(),
                None)


def _plain_attributes(model: torch.nn.Module) -> dict:
    """Every module's own public settings (numbers, strings, flags), by module name."""
    return {name: {k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, (bool, int, float, str))}
            for name, m in model.named_modules()}


def test_the_schedule_gives_the_balance_loss_its_share_of_a_step_and_parallelize_leaves_the_model_as_built():
    """A step of 2 accumulated micro-batches computes one step's gradients on the whole batch, the
    balance loss included: the schedule says each forward's share of the step, as it divides the task
    loss (Megatron-LM's schedules scale the MoE loss the same way) -- parallelize sets nothing on the
    model's own layers."""
    from distlab.models import build_model, task_loss
    from distlab.parallel import Strategy, build_mesh, parallelize
    torch.manual_seed(0)
    model = build_model("gpt-moe", (8,), 16, n_layer=1, n_head=2, n_embd=8, experts=4, aux_coef=1.0).to(F64)
    x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    grads = {}
    for k in (1, 2):
        copied = copy.deepcopy(model)
        built = _plain_attributes(copied)
        engine = parallelize(copied, Strategy(grad_accum=k), build_mesh(1))
        assert _plain_attributes(engine.module) == built, f"parallelize changed the model's settings (accum {k})"
        engine.forward_backward(x, y, task_loss)
        grads[k] = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    # float64, the same sums in another order: 32 tokens x 8 features x 4 experts x 2 layers feed a gradient entry
    bound = sum_tolerance(32 * 8 * 4 * 2, max(1.0, *(g.abs().max().item() for g in grads[1].values())), F64)
    router = [n for n in grads[1] if "router" in n]
    assert router and all(grads[1][n].abs().max() > 0 for n in router)
    for n in grads[1]:
        assert (grads[1][n] - grads[2][n]).abs().max() <= bound, n
