"""Muon (``--optimizer muon``, distlab.train.muon): its step is the reference formula; on every cut of a matrix --
ZeRO's flat shards, tensor parallel's slices, both -- the orthogonalised update is the whole matrix's, bit for bit
(gathered to one owner, computed once, scattered back); under ZeRO-1/2/3 on 2 ranks a run is data parallel's run
bit for bit (two ranks' means are the same sums in any order, so the gradients agree exactly and only the
optimizer could differ); orthogonalising each rank's shard instead -- the mistake the gathers exist for -- does
not; and the planner holds the state and the bytes a run does, to the byte."""

import json
import math

import pytest
import torch
from torch import nn

from distlab import runtime
from distlab.launch.spawn import run_ranks
from distlab.models.parameter_roles import matrix_names
from distlab.train import Trainer, TrainConfig
from distlab.train import muon as muon_module
from distlab.train.muon import Level, Muon, orthogonalised, zeropower
from tests.conftest import patience


def _reference_ns(g: torch.Tensor) -> torch.Tensor:
    """Keller Jordan's zeropower_via_newtonschulz5, written out again (float32)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float() / (g.float().norm() + 1e-7)
    if g.size(0) > g.size(1):
        x = x.T
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


def test_a_step_is_the_reference_formula_and_the_rest_is_adamw():
    torch.manual_seed(0)
    w, bias = nn.Parameter(torch.randn(6, 10)), nn.Parameter(torch.randn(6))
    w0, b0 = w.detach().clone(), bias.detach().clone()
    twin = nn.Parameter(b0.clone())
    opt = Muon([{"params": [w], "muon": True}, {"params": [bias]}], lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW([twin], lr=0.02, weight_decay=0.1)
    buf = torch.zeros_like(w0)
    expect = w0.clone()
    for step in range(3):
        g, gb = torch.randn(6, 10), torch.randn(6)
        w.grad, bias.grad, twin.grad = g, gb, gb.clone()
        opt.step()
        adamw.step()
        buf = 0.95 * buf + g
        update = _reference_ns(g + 0.95 * buf)
        expect = expect * (1 - 0.02 * 0.1) - 0.02 * 0.2 * math.sqrt(10) * update
        assert torch.allclose(w, expect, rtol=0, atol=1e-6), step
        assert torch.equal(bias, twin)  # the AdamW group is torch's AdamW, bit for bit
    assert zeropower(torch.randn(5, 3, 4)).shape == (5, 3, 4)  # stacked experts: a batch of matrices
    sv = torch.linalg.svdvals(zeropower(torch.randn(4, 8)))  # U V^T's singular values are 1; NS5's quintic
    assert ((sv > 0.6) & (sv < 1.3)).all(), sv  # leaves them in about [0.7, 1.2], by design (fast, not exact)


def test_muon_steps_the_weights_of_matrix_products_and_leaves_embeddings_and_the_head_to_adamw():
    from distlab.models import build_model
    gpt = build_model("gpt", (8,), 32, n_layer=1, n_embd=16, n_head=2)
    names = matrix_names(gpt)
    assert names and all(".attn." in n or ".mlp." in n for n in names)
    mlp = build_model("mlp", (1, 8, 8), 4, widths=(32, 16))
    assert matrix_names(mlp) == {"net.1.weight", "net.3.weight"}  # the last Linear is the output layer


def _cuts(rank, world):
    """Rank ``rank``'s pieces of three whole matrices and NS5 of each, cut four ways over 4 ranks."""
    import torch.distributed as dist
    torch.manual_seed(1)
    whole = [torch.randn(8, 6), torch.randn(4, 10), torch.randn(6, 8)]
    expect = [zeropower(m) for m in whole]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = pairs[rank // 2]  # tensor parallel over {0,1} and {2,3}
    zs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    zero = zs[rank % 2]  # ZeRO over {0,2} and {1,3}
    out = []
    for i, (m, o) in enumerate(zip(whole, expect)):
        flat = torch.zeros(math.ceil(m.numel() / 4) * 4)
        flat[:m.numel()] = m.reshape(-1)
        got = orthogonalised(flat.view(4, -1)[rank].clone(), [Level(None, None, tuple(m.shape))], i)
        ok_flat = torch.equal(got, torch.cat([o.reshape(-1), torch.zeros(flat.numel() - m.numel())]).view(4, -1)[rank])
        dim = i % 2  # column (dim 0) or row (dim 1) parallel
        piece = m.chunk(2, dim=dim)[rank % 2]
        got = orthogonalised(piece.clone(), [Level(tp, dim, tuple(m.shape))], i)
        ok_tp = torch.equal(got, o.chunk(2, dim=dim)[rank % 2])
        local, local_o = piece, o.chunk(2, dim=dim)[rank % 2]  # ZeRO over the tensor-parallel slice
        shard = math.ceil(local.numel() / 2)
        padded = torch.zeros(2 * shard)
        padded[:local.numel()] = local.reshape(-1)
        got = orthogonalised(padded.view(2, -1)[rank // 2].clone(),
                             [Level(zero, None, tuple(local.shape)), Level(tp, dim, tuple(m.shape))], i)
        want = torch.zeros(2 * shard)
        want[:local.numel()] = local_o.reshape(-1)
        ok_both = torch.equal(got, want.view(2, -1)[rank // 2])
        out.append((ok_flat, ok_tp, ok_both))
    return out


def test_every_cut_of_a_matrix_gets_the_whole_matrix_orthogonalised_bit_for_bit():
    """ZeRO's flat shards over 4 ranks, tensor parallel's columns or rows over 2, and ZeRO over 2 of each slice:
    each rank's piece of the update is its piece of NS5 of the whole matrix, exactly."""
    for rank_result in run_ranks(_cuts, 4, timeout=patience(120)):
        assert rank_result == [(True, True, True)] * 3


def _cfg(**kw):
    return TrainConfig.from_flags(**{**dict(model="gpt", n_layer=2, n_embd=32, n_head=2, dataset="synthetic-text:4000",
                                            block_size=16, global_batch_size=8, max_steps=4, lr=0.01,
                                            optimizer="muon", weight_decay=0.1, seed=1, log_every=1, progress=False,
                                            verbose=False, eval_every_epoch=False, eval_batches=1), **kw})


def _train(rank, world, cfgs, shard_only):
    real = muon_module.levels_of
    if shard_only:  # each rank orthogonalises the piece it holds: no gathers
        muon_module.levels_of = lambda engine: {}
        import distlab.train.trainer as trainer_module
        trainer_module.levels_of = muon_module.levels_of
    try:
        out = []
        for cfg in cfgs:
            trainer = Trainer(cfg.validate(world), runtime.from_process_group())
            trainer.fit()
            out.append(trainer.full_parameters())
        return out
    finally:
        import distlab.train.trainer as trainer_module
        muon_module.levels_of = trainer_module.levels_of = real


def test_muon_under_zero_is_data_parallels_run_bit_for_bit_and_a_shards_own_orthogonalisation_is_not():
    layouts = [{}, {"zero": 1}, {"zero": 2}, {"zero": 3}]
    dp, *zeros = run_ranks(_train, 2, [_cfg(**kw) for kw in layouts], False, timeout=patience(300))[0]
    for kw, params in zip(layouts[1:], zeros):
        assert all(torch.equal(a, b) for a, b in zip(dp, params)), kw
    wrong = run_ranks(_train, 2, [_cfg(zero=2)], True, timeout=patience(300))[0][0]
    assert not all(torch.equal(a, b) for a, b in zip(dp, wrong))  # (the right ones equal it exactly, above)


@pytest.mark.parametrize("layout", [["--zero", "3"], ["--tp", "2"]])
def test_plan_holds_muons_state_and_bytes_to_the_byte(run_cli, tmp_path, layout):
    """`distlab train --optimizer muon` under ZeRO-3 and tensor parallel holds the model state and sends the bytes
    `distlab plan --optimizer muon` prints: its momentum alone for each matrix, AdamW's moments for the rest, and
    each cut matrix's gather to its owner and scatter back."""
    same = ["--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--dataset", "synthetic-text:4000",
            "--block-size", "16", "--global-batch-size", "8", "--optimizer", "muon", *layout]
    run_cli("train", *same, "--weight-decay", "0.1", "--max-steps", "3", "--nproc-per-node", "2", "--no-progress",
            "--eval-batches", "1",
            "--out", str(tmp_path / "run"), timeout=patience(300), check=True)
    dp = 2 if "--zero" in layout else 1
    run_cli("plan", *same, "--dp", str(dp), "--json", str(tmp_path / "plan.json"), check=True)
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert ran["model_state_bytes_per_rank"] == planned["model_state_bytes_per_rank"]
    assert ran["comm_bytes_per_step"] == planned["comm_bytes_per_step_per_rank"]
    assert planned["comm_bytes_by"]["optimizer"] > 0
