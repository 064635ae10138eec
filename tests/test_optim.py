"""AdamW's weight-decay groups (GPT-2's and minGPT's convention): biases, norms and embeddings are not
decayed, on every layout -- the groups are chosen by the whole model's names, however ZeRO, tensor or
pipeline parallel cut the parameters -- and snapshots move the groups' state between layouts."""

import copy
import json

import pytest
import torch

from distlab.models.gpt import GPT
from distlab.train.optim import no_decay_names

LR, WD = 0.01, 0.5


def test_biases_norms_and_embeddings_are_not_decayed():
    model = GPT(32, 8, n_layer=1, n_head=2, n_embd=8, experts=2, top_k=1)
    skip = no_decay_names(model)
    assert {"0.tok.weight", "0.pos.weight", "1.ln1.weight", "1.ln1.bias", "1.attn.proj.bias",
            "1.mlp.experts.up_bias", "1.mlp.experts.down_bias", "2.ln.weight"} <= skip
    decayed = {n for n, _ in model.named_parameters()} - skip
    assert decayed == {"1.attn.q.weight", "1.attn.k.weight", "1.attn.v.weight", "1.attn.proj.weight",
                       "1.mlp.router.weight", "1.mlp.experts.up_weight", "1.mlp.experts.down_weight",
                       "2.out.weight"}, decayed


def _decay_only(rank, world, flags):
    """One AdamW step with every gradient zero: Adam moves nothing, so each parameter is either decayed
    -- ``p x (1 - lr x wd)``, computed as torch does -- or exactly as it was."""
    from distlab.parallel import Mesh, Strategy, parallelize
    from distlab.parallel.placement import placement_of
    from distlab.train.config import TrainConfig
    from distlab.train.optim import build_optimizer
    torch.manual_seed(0)
    full = GPT(32, 8, n_layer=2, n_head=2, n_embd=8)
    before = {k: v.clone() for k, v in full.state_dict().items()}
    skip = no_decay_names(full)
    strategy = Strategy(**flags).check(world)
    engine = parallelize(copy.deepcopy(full), strategy,
                         Mesh.of(strategy))
    cfg = TrainConfig.from_flags(optimizer="adamw", lr=LR, weight_decay=WD, lr_scaling="none")
    names = [p["name"] for p in placement_of(engine)["params"]]
    optimizer = build_optimizer(engine.parameters(), cfg, names, skip)
    for p in engine.parameters():
        p.grad = torch.zeros_like(p)
    engine.step(optimizer)
    after = engine.full_state_dict()
    wrong = [k for k, v in before.items() if k in after and not torch.equal(after[k], v if k in skip else v * (1 - LR * WD))]
    return wrong, len(after)


@pytest.mark.parametrize("flags", [{"dp_sync": "bucketed"}, {"zero": 1}, {"zero": 3}, {"dp_sync": "allreduce", "tp": 2},
                                   {"dp_sync": "bucketed", "pp": 2, "microbatches": 2}])
def test_each_layout_decays_exactly_the_weights_of_matrix_multiplications(flags):
    from distlab.launch.spawn import run_ranks
    for wrong, count in run_ranks(_decay_only, 2, flags, timeout=120):
        assert count and wrong == [], wrong


def test_a_run_with_decay_groups_resumes_on_another_layout(run_cli, tmp_path):
    flags = ["train", "--model", "gpt", "--dataset", "synthetic-text:4000", "--n-layer", "1", "--n-head", "2",
             "--n-embd", "16", "--block-size", "8", "--optimizer", "adamw", "--weight-decay", "0.1", "--lr", "0.01",
             "--lr-schedule", "constant", "--global-batch-size", "8", "--nproc-per-node", "2", "--log-every", "1",
             "--no-progress"]
    run_cli(*flags, "--max-steps", "2", "--zero", "2", "--snapshot-dir", "s", "--out", "r", check=True)
    proc = run_cli(*flags, "--max-steps", "4", "--tp", "2", "--snapshot-dir", "s", "--out", "r", "--resume", "auto",
                   check=True)
    assert "resharded from 2 ranks (zero=2) to 2 (bucketed+tp=2)" in proc.stderr
    meta = json.loads(next((tmp_path / "s").glob("step-00000004")).joinpath("meta.json").read_text())
    assert meta["weight_decay_groups"] == "no decay on biases, norms, embeddings"


@pytest.mark.parametrize("schedule,warmup", [("constant", 0), ("constant", 3), ("cosine", 0)])
def test_every_schedule_keeps_lambda_lrs_state_and_rates(schedule, warmup):
    """A constant schedule's step only counts; its state and rates stay LambdaLR's, step for step (so a
    snapshot of either reads the same), as do the warm-up's and the cosine's."""
    from distlab.train.config import TrainConfig
    from distlab.train.optim import build_scheduler, lr_multiplier
    cfg = TrainConfig.from_flags(lr_schedule=schedule, warmup_steps=warmup)
    ours, theirs = (torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1) for _ in range(2))
    mine = build_scheduler(ours, cfg, 10)
    ref = torch.optim.lr_scheduler.LambdaLR(theirs, lambda s: lr_multiplier(s, cfg, 10))
    for _ in range(6):
        ours.step(), theirs.step()
        mine.step(), ref.step()
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
        assert {k: v for k, v in mine.state_dict().items() if k != "lr_lambdas"} == \
            {k: v for k, v in ref.state_dict().items() if k != "lr_lambdas"}
