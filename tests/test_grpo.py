"""GRPO from rewards (distlab.train.grpo, rollout, rewards; distlab.data.rl): the loss is TRL's formula, the
rollouts are seeded per prompt, the command trains, resumes and refuses bad input in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from distlab.tools.verify import sum_tolerance

F64 = torch.float64

TINY = ["--model", "gpt", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "12",
        "--global-batch-size", "4", "--log-every", "1", "--no-progress", "--lr", "0.05", "--lr-schedule", "constant",
        "--comm-timeout", "60"]


def _trl(logp, old, ref, adv, mask, eps_low, eps_high, beta, how, max_len):
    """TRL's GRPOTrainer._compute_loss, written out: the per-token loss, then its normalisation."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token_loss = per_token_loss + beta * per_token_kl
    if how == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if how == "dapo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)


@pytest.mark.parametrize("how", ["grpo", "dapo", "dr_grpo"])
def test_the_loss_and_its_gradient_are_trls_formula(how):
    """Two groups of three completions, off-policy (the old log-probabilities apart from the policy's, so the clip
    bites both ways) with a KL to a reference: distlab's token losses and weights give TRL's loss and the same
    gradient to the policy's log-probabilities, in float64."""
    from distlab.train.grpo import advantages, token_losses, token_weights
    g = torch.Generator().manual_seed(0)
    rows, t = 6, 5
    logp = (-torch.rand(rows, t, generator=g, dtype=F64) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(rows, t, generator=g, dtype=F64)
    ref = logp.detach() + 0.2 * torch.randn(rows, t, generator=g, dtype=F64)
    mask = torch.ones(rows, t, dtype=F64)
    mask[0, 3:], mask[4, 1:], mask[5, 4:] = 0, 0, 0  # completions of 3, 1 and 4 tokens beside full ones
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]], dtype=F64)
    adv = advantages(rewards).view(-1)
    y = torch.stack([torch.zeros(rows, t, dtype=F64), adv[:, None].expand(rows, t), old, ref,
                     token_weights(mask, how, rows, float(mask.sum()), t)], -1)
    losses, _, clipped = token_losses(logp, y, 0.2, 0.28, 0.05, on_policy=False)
    ours = (losses * y[..., 4]).masked_fill(mask == 0, 0).sum()
    (grad,) = torch.autograd.grad(ours, logp)
    theirs = _trl(logp, old, ref, adv, mask, 0.2, 0.28, 0.05, how, t)
    (want,) = torch.autograd.grad(theirs, logp)
    assert clipped[mask.bool()].any() and not clipped[mask.bool()].all()
    bound = sum_tolerance(rows * t, float(losses.abs().max()), F64)
    assert abs(ours.item() - theirs.item()) <= bound and (grad - want).abs().max() <= bound
    # the group's advantages: reward minus the group's mean, over its unbiased std (+1e-4)
    assert torch.allclose(advantages(rewards)[0], (rewards[0] - rewards[0].mean()) / (rewards[0].std() + 1e-4))


def test_a_prompts_completions_are_seeded_by_it_and_end_at_a_stop():
    """The same prompt, rollout and seed draw the same completions whatever else is drawn; another rollout draws
    others; a completion ends at its stop token (kept) or the budget."""
    from distlab.models import GPT
    from distlab.train import rollout
    torch.manual_seed(0)
    model = GPT(256, 16, 1, 2, 16).eval()
    prompt = list(b"12+3=")
    a, _, _ = rollout.complete(model, prompt, 4, 6, 1.0, 1.0, frozenset({10}), rollout.seed_of(0, 3, 7))
    b, _, _ = rollout.complete(model, prompt, 4, 6, 1.0, 1.0, frozenset({10}), rollout.seed_of(0, 3, 7))
    c, _, _ = rollout.complete(model, prompt, 4, 6, 1.0, 1.0, frozenset({10}), rollout.seed_of(0, 4, 7))
    assert a == b and a != c
    stops = {t for done in a for t in done[:1]}  # every first token made a stop: each completion is that token
    d, _, _ = rollout.complete(model, prompt, 4, 6, 1.0, 1.0, frozenset(stops), rollout.seed_of(0, 3, 7))
    assert [len(x) for x in d] == [1] * 4 and all(len(x) == 6 or x[-1] == 10 for x in a)
    x, y = rollout.window(prompt, a[0], 12)
    assert (y >= 0).sum() == len(a[0]) and x[:len(prompt)].tolist() == prompt


def _records(tmp_path) -> str:
    lines = [json.dumps({"prompt": f"{a}+{a % 7}=", "answer": str(a + a % 7)}) for a in range(60)]
    (tmp_path / "sums.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "mine.py").write_text("def score(completion, record):\n    return float(any(c.isdigit() for c in "
                                      "completion))\n\ndef bad(completion, record):\n    return 'yes'\n")
    return f"rl:{tmp_path / 'sums.jsonl'}"


def test_the_cli_learns_from_rewards_logs_them_and_resumes_bitwise(run_cli, tmp_path):
    """ZeRO-3 on 2 ranks, a reward of the user's own beside a built-in one, weighted, a KL to the starting model:
    each step logs the reward (and each reward's), the completions' length, entropy, KL and clipped share; the
    evaluation the test prompts' greedy rewards. Stopped at step 2 and resumed, it ends where the uninterrupted
    run does, every loss the same to the last bit."""
    data = _records(tmp_path)
    common = ["train", *TINY, "--dataset", data, "--reward", f"{tmp_path / 'mine.py'}:score,exact",
              "--reward-weights", "1,0.5", "--group-size", "3", "--kl-beta", "0.05", "--max-new-tokens", "4",
              "--nproc-per-node", "2", "--zero", "3", "--max-steps", "4"]
    run_cli(*common, "--out", "whole", check=True, timeout=240)
    run_cli(*common, "--snapshot-dir", "s", "--snapshot-every", "2", "--max-steps", "2", "--out", "first",
            check=True, timeout=240)
    proc = run_cli(*common, "--snapshot-dir", "s", "--resume", "auto", "--out", "second", check=True, timeout=240)
    assert "| reward " in proc.stdout and "test reward" in proc.stdout
    whole = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    for r in whole:
        assert {"reward", "reward_exact", "completion_length", "entropy", "kl", "clip_fraction"} <= set(r), r
        assert 0 <= r["reward_exact"] <= 1 and 1 <= r["completion_length"] <= 4
    assert whole[-1]["kl"] > 0 and "test_reward" in whole[-1]
    resumed = [json.loads(line) for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in resumed if r["step"] > 2] == [r["loss"] for r in whole if r["step"] > 2]
    assert [r["reward"] for r in resumed if r["step"] > 2] == [r["reward"] for r in whole if r["step"] > 2]


@pytest.mark.parametrize("flags,message", [
    (["--dataset", "synthetic-text:3000", "--reward", "exact"], "reward is GRPO's"),
    (["--group-size", "1"], "sample at least 2"),
    (["--reward", "nosuch"], "unknown --reward 'nosuch'"),
    (["--reward", "exact,number", "--reward-weights", "1"], "gives 1 weights for 2 rewards"),
    (["--reward", "regex:(["], "not a regular expression"),
    (["--temperature", "0"], "draws the same completion"),
    (["--ppo-epochs", "2", "--snapshot-dir", "s", "--snapshot-every", "3"], "give a multiple of 2"),
])
def test_bad_grpo_settings_are_one_line_before_launch(refused_here, tmp_path, flags, message):
    data = _records(tmp_path)
    proc = refused_here("train", *TINY, "--dataset", data, "--max-steps", "1", *flags)
    assert message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_reward_that_returns_no_number_or_needs_an_answer_stops_the_run_saying_so(run_cli, tmp_path):
    data = _records(tmp_path)
    bad = run_cli("train", *TINY, "--dataset", data, "--max-steps", "1", "--reward", f"{tmp_path / 'mine.py'}:bad")
    assert bad.returncode != 0 and "returned 'yes' for a completion: a reward is a number" in bad.stderr, bad.stderr
    (tmp_path / "bare.jsonl").write_text("\n".join(json.dumps({"prompt": f"{i}="}) for i in range(20)) + "\n")
    none = run_cli("train", *TINY, "--dataset", f"rl:{tmp_path / 'bare.jsonl'}", "--max-steps", "1")
    assert none.returncode != 0 and "add \"answer\" to every line" in none.stderr, none.stderr


def test_a_grpo_run_killed_mid_run_resumes_bitwise_through_the_fault_drill(run_cli, tmp_path):
    """``distlab verify --faults kill`` on a GRPO case: a rank SIGKILLed mid-run, the job restarted from its
    snapshot, ends with the uninterrupted run's model to the last bit (the rollouts redrawn alike)."""
    run_cli("verify", "--faults", "kill", "--nproc", "2", "--strategy", "bucketed+gpt+grpo", "--steps", "8",
            "--json", "drill.json", check=True, timeout=600)
    (record,) = json.loads((tmp_path / "drill.json").read_text())
    assert record["passed"] and record["max_abs_param_diff"] == 0.0, record


def test_grpo_from_a_hugging_face_checkpoint_with_peft_adapters_on_tp_2_is_one_processs(run_cli, tmp_path):
    """A Llama checkpoint and PEFT adapters that move it (random A and B): GRPO with LoRA on tensor parallel 2
    draws one process's rollouts (the same rewards and lengths, exactly) and logs its KL to the base (the adapters
    off) within float32 rounding, step after step."""
    from tests.test_dpo import adapted_checkpoint
    adapted = adapted_checkpoint(tmp_path)
    data = _records(tmp_path)
    runs = {}
    for name, layout in (("one", []), ("tp2", ["--nproc-per-node", "2", "--tp", "2"])):
        run_cli("train", *layout, "--init-from", f"hf:{tmp_path / 'base'}", "--lora-from",
                f"peft:{tmp_path / 'adapter'}", "--dataset", data, "--block-size", "12", "--global-batch-size", "4",
                "--group-size", "3", "--kl-beta", "0.1", "--reward", "exact", "--max-steps", "2", "--log-every", "1",
                "--lr", "0.01", "--no-progress", "--comm-timeout", "60", "--out", str(tmp_path / name), check=True,
                timeout=300)
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    # a token's log-probability: float32 sums in another order -- the head's 32-wide dot products, the log-sum-exp
    # over 256 logits, through 2 blocks -- each run within sum_tolerance of the exact one (the logits' size measured
    # on a prompt); the KL's k3 term moves by |exp(d) - 1| <= 2 sqrt(2 kl) (small d) per unit of d
    with torch.no_grad():
        scale = float(adapted(torch.tensor([list(b"12+5=")])).logits.abs().max()) + 1
    delta = 2 * sum_tolerance(256 + 2 * 2 * 96, scale)
    for a, b in zip(runs["one"], runs["tp2"]):
        assert a["reward"] == b["reward"] and a["completion_length"] == b["completion_length"]
        bound = 2 * (2 * a["kl"]) ** 0.5 * delta + delta ** 2
        assert a["kl"] > 0 and abs(a["kl"] - b["kl"]) <= bound, (a["kl"], b["kl"], bound)


def test_the_planner_prices_a_grpo_update_exactly_on_data_parallel(run_cli, tmp_path):
    """``plan`` of a GRPO run on 2 data-parallel ranks: the update -- each prompt's completions a window -- sends
    the bytes and holds the model state the run measures, to the byte; the rollout before it counts each rank's
    prompts, decoding steps and the generation copy it holds, the completions the run draws within its budget."""
    shape = ["--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
             "--dataset", "synthetic-rl", "--global-batch-size", "8", "--group-size", "4", "--max-new-tokens", "5"]
    plan = run_cli("plan", *shape, "--dp", "2", "--json", "plan.json", check=True)
    assert "decoding steps a rank" in plan.stdout and "1 float32 copy of the whole model" in plan.stdout
    run_cli("train", *shape, "--max-steps", "3", "--nproc-per-node", "2", "--no-progress", "--comm-timeout", "60",
            "--out", "run", check=True, timeout=240)
    predicted = json.loads((tmp_path / "plan.json").read_text())
    measured = json.loads((tmp_path / "run" / "summary.json").read_text())
    r = predicted["rollout"]
    counts = (r["rows_per_step"], r["prompts_per_rank"], r["max_new_tokens"], r["decode_steps_per_rank"])
    assert counts == (32, 4, 5, 16)
    assert r["memory_bytes_per_rank"] >= 4 * predicted["num_parameters"] and r["scoring_passes"] == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(1 <= row["completion_length"] <= r["max_new_tokens"] for row in rows)
    assert predicted["comm_bytes_per_step_per_rank"] == measured["comm_bytes_per_step"]
    assert predicted["model_state_bytes_per_rank"] == measured["model_state_bytes_per_rank"]


def _first_rollout(rank, world, flags: dict):
    """The first step's rollout of a GRPO run set by ``flags``, drawn as the run draws it: every train prompt's
    completions (their rows and targets) and the run's settings."""
    from distlab import runtime
    from distlab.train import TrainConfig, Trainer
    cfg = TrainConfig.from_flags(**flags).validate(1)
    trainer = Trainer(cfg, runtime.from_process_group())
    data = trainer.train_set
    x, y = data.batch(torch.arange(len(data)))[:2]
    rows, targets, _ = trainer.objective.batch(x, y, None, 1)
    return rows, targets[..., 0].long(), cfg


def test_a_grpo_steps_loss_and_update_are_trls_formula_from_transformers_log_probabilities(run_cli, tmp_path):
    """A Llama checkpoint with PEFT adapters that move it, every train prompt in one step's batch: the logged loss
    is TRL's GRPO loss, and the adapters' SGD step TRL's gradient, both computed by hand from transformers' and
    PEFT's float64 log-probabilities of the completions the run drew (the policy: base + adapters; the KL's
    reference: the adapters off) and the rewards recomputed from the decoded text -- within transformers' own
    float32 rounding per logit (the loss) and verify's float32 bound for the step (the update)."""
    import re

    from safetensors.torch import load_file

    from distlab.launch.spawn import run_ranks
    from distlab.models import IGNORE_INDEX
    from distlab.tools.verify_data import grpo_tolerance
    from tests.conftest import patience
    from tests.test_dpo import adapted_checkpoint
    adapted = adapted_checkpoint(tmp_path)
    data, g, beta, lr = _records(tmp_path), 3, 0.1, 0.05
    flags = dict(init_from=f"hf:{tmp_path / 'base'}", lora_from=f"peft:{tmp_path / 'adapter'}", dataset=data,
                 block_size=12, global_batch_size=54, group_size=g, kl_beta=beta, reward="regex:[0-9]",
                 max_new_tokens=4, max_steps=1, optimizer="sgd", momentum=0.0, lr=lr, lr_schedule="constant",
                 log_every=1, progress=False, verbose=False, seed=5)
    run_cli("train", *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items() if k not in ("progress", "verbose")),
            "--no-progress", "--out", "run", check=True, timeout=300)
    run_cli("export", "run", "--format", "peft", "--out", "moved", check=True)
    rows, target, cfg = run_ranks(_first_rollout, 1, flags, timeout=patience(300))[0]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    mask = (target != IGNORE_INDEX).double()
    text = ["".join(chr(t) for t, m in zip(row, keep) if m and t != 10) for row, keep in zip(target.tolist(), mask)]
    rewards = torch.tensor([float(bool(re.search("[0-9]", s))) for s in text], dtype=F64).view(-1, g)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    assert 0 < rewards.mean() < 1 and len(rows) == 54 * g

    def logps(model):
        logits = model(rows).logits.double()
        picked = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0)[..., None])[..., 0]
        return picked * mask

    adapted = adapted.double().eval()
    with torch.no_grad(), adapted.disable_adapter():
        ref = logps(adapted)
    policy = logps(adapted)
    loss = _trl(policy, policy.detach(), ref, adv, mask, 0.2, 0.2, beta, "grpo", 4)
    trained = {n: p for n, p in adapted.named_parameters() if p.requires_grad}
    grads = dict(zip(trained, torch.autograd.grad(loss, list(trained.values()))))
    with torch.no_grad():  # transformers' float32 rounding of its logits on these rows
        exact = adapted(rows[:8]).logits
        per_logit = 2 * (adapted.float()(rows[:8]).logits.double() - exact).abs().max().item() \
            + 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    adapted.double()
    # a token's log-probability within 2 x per_logit (its logit and the log-sum-exp's), the KL's k3 moving by
    # |exp(d) - 1| per unit of d, for the policy and the reference; the ratio's term is -A exactly (on-policy)
    d = (ref - policy.detach()).abs().max().item()
    bound = beta * 2 * (2 * per_logit) * (math.expm1(d) + 2 * per_logit) + 1e-12
    assert abs(first["loss"] - loss.item()) <= bound, (first["loss"], loss.item(), bound)
    assert abs(loss.item()) > 100 * bound  # (the KL is not trivially 0: the adapters moved the model)
    start, moved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")), \
        load_file(str(tmp_path / "moved" / "adapter_model.safetensors"))
    step_bound = grpo_tolerance(cfg, 1)
    assert set(start) == set(moved) == {n.replace(".default", "") for n in grads}
    for name, grad in grads.items():
        key = name.replace(".default", "")
        want = start[key].double() - lr * grad
        assert (moved[key].double() - want).abs().max().item() <= step_bound, key
    assert max((moved[k].double() - start[k].double()).abs().max().item() for k in start) > 100 * step_bound
