"""Adam's moments in bfloat16 (distlab.train.low_precision_optim, ``--optimizer-state bf16``): each step is torch's
with the state rounded after it, bit for bit; the second moment stalls where bfloat16 cannot hold its increment; the
command trains with it under ZeRO, holds the state the planner predicts to the byte, and resumes bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.train.low_precision_optim import Adam16


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=g).requires_grad_(), torch.randn(7, generator=g).requires_grad_()]


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_a_step_is_torchs_with_the_state_rounded_after_it_bit_for_bit(decoupled):
    """Six steps of random gradients (weight decay on): with float32 state, torch's Adam/AdamW exactly; with
    bfloat16 state, torch's whose moments are rounded to bfloat16 after every step -- parameters and state."""
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ours, wide, theirs, plain = _params(0), _params(0), _params(0), _params(0)
    opt = Adam16(ours, lr=0.01, weight_decay=0.1, decoupled=decoupled)
    opt32 = Adam16(wide, lr=0.01, weight_decay=0.1, decoupled=decoupled, state_dtype=torch.float32)
    ref = torch_cls(theirs, lr=0.01, weight_decay=0.1, foreach=False)
    ref32 = torch_cls(plain, lr=0.01, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        grads = [torch.randn(p.shape, generator=g) * 10 ** torch.randint(-3, 2, (), generator=g) for p in ours]
        for group in (ours, wide, theirs, plain):
            for p, grad in zip(group, grads):
                p.grad = grad.clone()
        for o in (opt, opt32, ref, ref32):
            o.step()
        for p in theirs:  # torch's state, rounded as ours is stored
            for key in ("exp_avg", "exp_avg_sq"):
                ref.state[p][key].copy_(ref.state[p][key].bfloat16().float())
    for a, b, c, d in zip(ours, theirs, wide, plain):
        assert torch.equal(a, b) and torch.equal(c, d)
        assert opt.state[a]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(opt.state[a]["exp_avg_sq"].float(), ref.state[b]["exp_avg_sq"])
    assert not all(torch.equal(a, d) for a, d in zip(ours, plain))  # the rounding moved the parameters


def test_the_second_moment_stalls_where_bfloat16_cannot_hold_its_increment():
    """``v = 1`` and gradients of 0.01: each step adds ``0.001 x 1e-4``, far below half of bfloat16's unit at 1
    (2^-8): stored in bfloat16, ``v`` decays by ``0.999`` -- a change it rounds away too -- and stays 1; in float32
    it falls towards the gradients' square."""
    p16, p32 = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    opts = [Adam16([p16], lr=1e-3), Adam16([p32], lr=1e-3, state_dtype=torch.float32)]
    for o, p in zip(opts, (p16, p32)):
        p.grad = torch.ones(4)
        o.step()
        o.state[p]["exp_avg_sq"].fill_(1.0)
        for _ in range(50):
            p.grad = torch.full((4,), 0.01)
            o.step()
    assert torch.equal(opts[0].state[p16]["exp_avg_sq"].float(), torch.ones(4))
    assert (opts[1].state[p32]["exp_avg_sq"] < 0.96).all()


TINY = ["--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--dataset", "synthetic-text:4000", "--global-batch-size", "8", "--optimizer", "adamw"]


def test_the_command_trains_with_bf16_moments_under_zero_holds_what_plan_predicts_and_resumes_bitwise(run_cli,
                                                                                                    tmp_path):
    """``--optimizer-state bf16`` under ZeRO-2 on 2 ranks: the model state the run measures is the planner's to
    the byte, 4 bytes a trained parameter's shard less than float32's; stopped at step 2 and resumed (the moments
    read back in bfloat16, not widened as torch's loading would), every loss is the uninterrupted run's; resharded
    to one rank it still holds them in bfloat16 (the planner's bytes for one rank)."""
    common = ["train", *TINY, "--weight-decay", "0.1", "--lr-schedule", "constant", "--zero", "2", "--nproc-per-node",
              "2", "--no-progress", "--comm-timeout", "60", "--max-steps", "6", "--log-every", "1"]
    for state in ("fp32", "bf16"):
        run_cli(*common, "--optimizer-state", state, "--out", state, check=True, timeout=240)
        run_cli("plan", *TINY, "--dp", "2", "--zero", "2", "--optimizer-state", state, "--json", f"{state}.json",
                check=True)
    runs = {s: json.loads((tmp_path / s / "summary.json").read_text()) for s in ("fp32", "bf16")}
    plans = {s: json.loads((tmp_path / f"{s}.json").read_text()) for s in ("fp32", "bf16")}
    for s in ("fp32", "bf16"):
        assert plans[s]["model_state_bytes_per_rank"] == runs[s]["model_state_bytes_per_rank"], s
    shard = -(-plans["fp32"]["num_parameters"] // 2)  # (ZeRO's padded shard: within a few elements)
    saved = runs["fp32"]["model_state_bytes_per_rank"] - runs["bf16"]["model_state_bytes_per_rank"]
    assert abs(saved - 4 * shard) <= 4 * 2 * 64, (saved, 4 * shard)
    run_cli(*common, "--optimizer-state", "bf16", "--snapshot-dir", "s", "--snapshot-every", "2", "--max-steps", "2",
            "--out", "first", check=True, timeout=240)
    run_cli(*common, "--optimizer-state", "bf16", "--snapshot-dir", "s", "--resume", "auto", "--out", "second",
            check=True, timeout=240)
    whole, resumed = ([json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                      for d in ("bf16", "second"))
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert second["model_state_bytes_per_rank"] == runs["bf16"]["model_state_bytes_per_rank"]  # (still bfloat16)
    run_cli("train", *TINY, "--weight-decay", "0.1", "--lr-schedule", "constant", "--optimizer-state", "bf16",
            "--max-steps", "7",
            "--no-progress", "--snapshot-dir", "s", "--resume", "auto", "--out", "one", check=True, timeout=240)
    run_cli("plan", *TINY, "--optimizer-state", "bf16", "--json", "one.json", check=True)  # resharded to 1 rank
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["model_state_bytes_per_rank"] == \
        json.loads((tmp_path / "one.json").read_text())["model_state_bytes_per_rank"]
    assert resumed[-4:] == whole[-4:] and whole != [json.loads(line)["loss"] for line in
                                                    (tmp_path / "fp32" / "metrics.jsonl").read_text().splitlines()]


def test_bf16_state_for_sgd_is_refused_in_one_line(refused_here):
    proc = refused_here("train", "--optimizer", "sgd", "--optimizer-state", "bf16", "--max-steps", "1")
    assert "holds Adam's moments" in proc.stderr and "--optimizer adamw" in proc.stderr
