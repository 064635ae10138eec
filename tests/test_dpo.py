"""Direct preference optimisation (``--dataset dpo:FILE.jsonl``, distlab.train.preference): the paper's loss
from transformers' log-probabilities of the same pairs, equal to one process on every layout, chat pairs
rendered by the model's template, and bad pairs or flags refused before launch."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import patience

from distlab.models import IGNORE_INDEX

BETA = 0.1


def _pairs(path, n: int = 20) -> list[dict]:
    rows = [{"prompt": f"Q{i}: is {i} even?", "chosen": " yes." if i % 2 == 0 else " no.",
             "rejected": " no!" + "?" * (i % 3) if i % 2 == 0 else " yes, it is"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_dpo_on_every_layout_equals_one_process():
    """verify's DPO cases (ZeRO-3 with adapters, whose reference is the base with adapters off; context
    parallel summing each rank's tokens' log-probabilities; TP + SP's vocabulary-parallel head) and a
    pipeline's last stage scoring pairs: within verify's bound (beta x the pair's tokens' gradient)."""
    from distlab.tools.verify import default_strategies, parse_strategy, verify
    cases = [c for c in default_strategies(2) if c.dpo]
    assert len(cases) == 3 and any(c.lora for c in cases)
    cases.append(parse_strategy("bucketed+pp=2+microbatches=2+llama+dpo"))
    records = verify(cases, 2, steps=3, timeout=patience(600))
    failed = [(r["strategy"], r["max_abs_param_diff"], r["max_loss_diff"], r["tolerance"]) for r in records
              if not r["passed"]]
    assert not failed, failed


def _logps(model, ids: list[int], first: int) -> float:
    """Sum of the log-probabilities of ``ids[first:]`` given what precedes each (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return float(sum(logp[t - 1, ids[t]] for t in range(first, len(ids))))


def adapted_checkpoint(tmp_path):
    """A Llama checkpoint in ``tmp_path/base`` and PEFT adapters that move it (random A and B) in
    ``tmp_path/adapter``; the adapted model (skipped without peft, the test extra)."""
    peft = pytest.importorskip("peft", reason="peft (the test extra) is not installed: pip install -e '.[test]'")
    from tests.test_hf import _saved
    base = _saved("LlamaForCausalLM", tmp_path / "base")
    torch.manual_seed(1)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                        init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    return adapted


@pytest.mark.parametrize("layout", [[], ["--nproc-per-node", "2", "--tp", "2"]], ids=["one process", "tp 2"])
def test_the_first_steps_loss_is_the_papers_formula_from_transformers_log_probabilities(layout, run_cli, tmp_path):
    """A base checkpoint and a PEFT adapter that moves it (random A and B): the reference is the base (the
    adapters off), the trained model base + adapter. The first step's logged loss, reward margin and
    preference accuracy over the whole training set (one global batch) are the DPO paper's, computed from
    transformers' and PEFT's float64 log-probabilities of the same tokens -- within twice transformers' own
    float32 rounding per logit, times the tokens a pair sums over, times beta."""
    adapted = adapted_checkpoint(tmp_path)
    rows = _pairs(tmp_path / "pairs.jsonl")
    train = [r for i, r in enumerate(rows) if i % 10 != 9]
    block = 24
    run_cli("train", *layout, "--init-from", f"hf:{tmp_path / 'base'}", "--lora-from", f"peft:{tmp_path / 'adapter'}",
            "--dataset", f"dpo:{tmp_path / 'pairs.jsonl'}", "--block-size", str(block), "--global-batch-size",
            str(len(train)), "--max-steps", "1", "--log-every", "1", "--dpo-beta", str(BETA), "--no-progress",
            "--out", str(tmp_path / "run"), check=True)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    adapted = adapted.double().eval()
    losses, margins, worst = [], [], 0.0
    for r in train:
        prompt = list(r["prompt"].encode())
        rewards = []
        for completion in (r["chosen"], r["rejected"]):
            ids = (prompt + list(completion.encode()))[:block + 1]
            policy = _logps(adapted, ids, len(prompt))
            with adapted.disable_adapter():
                reference = _logps(adapted, ids, len(prompt))
            rewards.append(BETA * (policy - reference))
        margins.append(rewards[0] - rewards[1])
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(margins[-1], dtype=torch.float64)).item())
    with torch.no_grad():  # transformers' float32 rounding of its logits on these windows
        x = torch.tensor([(list(r["prompt"].encode()) + list(r["chosen"].encode()))[:block] for r in train[:1]])
        exact = adapted(x).logits
        rounded = adapted.float()(x).logits.double()
        per_logit = 2 * (rounded - exact).abs().max().item() + \
            4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    # a pair's margin sums 2 x block token log-probabilities, each within 2 x per_logit, for both models
    bound = BETA * 2 * block * 2 * 2 * per_logit
    assert abs(first["loss"] - sum(losses) / len(losses)) <= bound, (first["loss"], sum(losses) / len(losses), bound)
    assert abs(first["reward_margin"] - sum(margins) / len(margins)) <= bound
    assert min(abs(m) for m in margins) > bound  # (so the count below is exact)
    assert first["reward_accuracy"] == sum(m > 0 for m in margins) / len(margins)
    assert abs(first["loss"] - math.log(2)) > 100 * bound  # the adapter moved the model: not the trivial start


def test_chat_pairs_render_through_the_template_and_score_the_replies(tmp_path):
    """A conversational pair (TRL's explicit and implicit prompt forms): both windows start with the
    template's rendering of the conversation, and only each reply and its end of turn are targets."""
    from distlab.data import load_dataset
    from tests.test_chat_families import _family_dir, _transformers
    tok = _family_dir("llama3", tmp_path / "m")
    theirs = _transformers().AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    ask = [{"role": "user", "content": "the quick brown fox?"}]
    good, bad = [{"role": "assistant", "content": "the lazy dog"}], [{"role": "assistant", "content": "fox"}]
    rows = [{"prompt": ask, "chosen": good, "rejected": bad}, {"chosen": ask + good, "rejected": ask + bad}] * 10
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_dataset(f"dpo:{tmp_path / 'chat.jsonl'}", "train", block_size=192, tokenizer=f"hf:{tmp_path / 'm'}")
    x, y = data.batch(torch.arange(2))
    assert x.shape == (4, 192) and y.shape == (4, 192, 2)
    prompt = len(theirs.apply_chat_template(ask, tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"])
    for row, reply in zip(range(4), [good, bad, good, bad]):
        whole = theirs.apply_chat_template(ask + reply, tokenize=True, return_dict=True)["input_ids"]
        assert x[row, :len(whole)].tolist() == whole
        targets = y[row, :, 0][y[row, :, 0] != IGNORE_INDEX].long().tolist()
        assert targets == whole[prompt:], tok.decode(targets, skip_special_tokens=False)
    assert (y[..., 1] == 0).all()  # no reference yet: the run computes it


def test_bad_pairs_and_flags_are_refused_before_launch(refused_here, tmp_path):
    _pairs(tmp_path / "pairs.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": [{}]}) + "\n")
    base = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "24",
            "--max-steps", "1"]
    pairs = ["--dataset", f"dpo:{tmp_path / 'pairs.jsonl'}"]
    for extra, message in [
            (["--dataset", f"dpo:{tmp_path / 'bad.jsonl'}"], "bad.jsonl:1: a preference record is"),
            (["--dataset", f"dpo:{tmp_path / 'mixed.jsonl'}"], "all text or all chat messages"),
            (["--dataset", f"dpo:{tmp_path / 'none.jsonl'}"], "no such file"),
            ([*pairs, "--pack"], "drop --pack"),
            ([*pairs, "--label-smoothing", "0.1"], "DPO's loss is a pair's"),
            ([*pairs, "--dpo-beta", "0"], "--dpo-beta must be positive"),
            (["--dataset", "synthetic-text:2000", "--dpo-beta", "0.1"], "is not pairs")]:
        proc = refused_here(*base, *extra)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, (extra, proc.stderr)


def test_a_dpo_run_resumes_bitwise_and_the_report_draws_its_rewards(run_cli, tmp_path):
    """The whole model trained (no adapters): its reference is the starting model, which a resumed run no
    longer holds after loading its snapshot -- it recomputes the reference first, so a run stopped at step 2
    and resumed ends bitwise where the uninterrupted one does (a reference taken from the resumed weights
    would differ). The log and summary say DPO's loss, reward margin and preference accuracy, and `distlab
    report` draws the rewards."""
    from tests.test_lora import _whole
    base = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--dataset",
            "synthetic-pairs:60", "--block-size", "8", "--global-batch-size", "6", "--lr", "0.5", "--log-every", "1",
            "--lr-schedule", "constant", "--snapshot-every", "2", "--keep-snapshots", "5", "--no-progress",
            "--nproc-per-node", "2"]
    whole = run_cli(*base, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "a"), "--out", str(tmp_path / "arun"),
                    check=True)
    assert "54 preference pairs" in whole.stdout and "preference accuracy" in whole.stdout
    from distlab.train.evaluate import eval_batch  # a pair is two windows of logits: half as many at a time
    assert f"{eval_batch(None, True, 3, 8 * 256 * 2):,} at a time per rank" in whole.stdout, whole.stdout
    run_cli(*base, "--max-steps", "2", "--snapshot-dir", str(tmp_path / "b"), "--out", str(tmp_path / "brun"), check=True)
    run_cli(*base, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "b"), "--resume", "auto", "--out",
            str(tmp_path / "brun2"), check=True)
    a, b = (_whole(next((tmp_path / d).glob("step-*4"))) for d in ("a", "b"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    metrics = [json.loads(line) for line in (tmp_path / "arun" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the model is its reference at the start
    assert metrics[-1]["loss"] < metrics[0]["loss"] and metrics[-1]["reward_margin"] > 0
    summary = json.loads((tmp_path / "arun" / "summary.json").read_text())
    assert summary["loss_unit"] == "dpo" and summary["dpo_beta"] == BETA and "test_reward_margin" in summary
    run_cli("report", str(tmp_path / "arun"), "-o", str(tmp_path / "report.html"), check=True)
    page = (tmp_path / "report.html").read_text()
    assert "preference tuning (DPO)" in page and page.count("<img") >= 3


def test_pairs_whose_chosen_is_the_rejected_are_dropped_and_said_and_a_set_of_only_those_is_refused(run_cli,
                                                                                                      refused_here,
                                                                                                      tmp_path):
    """A pair whose two completions are the same text teaches nothing (loss log 2, gradient 0): such pairs are
    dropped and the header says how many; a set of only such pairs -- identical or both empty -- is refused
    before launch in one line."""
    rows = _pairs(tmp_path / "some.jsonl")
    for i in (0, 1, 2, 5):  # 4 of the 18 training pairs (i % 10 != 9) and none of the test ones
        rows[i]["rejected"] = rows[i]["chosen"]
    (tmp_path / "some.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": "yes" if i % 2 else "",
                                                             "rejected": "yes" if i % 2 else ""}) + "\n"
                                                 for i in range(20)))
    base = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--block-size", "24",
            "--global-batch-size", "4", "--max-steps", "1", "--no-progress"]
    proc = run_cli(*base, "--dataset", f"dpo:{tmp_path / 'some.jsonl'}", "--out", str(tmp_path / "run"), check=True)
    assert "14 preference pairs" in proc.stdout and \
        "4 pairs whose chosen completion is the rejected one dropped (nothing to prefer)" in proc.stdout, proc.stdout
    proc = refused_here(*base, "--dataset", f"dpo:{tmp_path / 'same.jsonl'}")
    assert proc.stderr.count("\n") == 1 and "the chosen completion is the rejected one" in proc.stderr, proc.stderr


def test_a_pair_file_is_read_once_by_the_command_and_a_large_one_shows_its_reading(tmp_path, monkeypatch):
    """`distlab train --dataset dpo:FILE` on one process: the pre-launch check, the training split and the test
    split share one read of the file (it was read three times: 10^5 chat pairs printed nothing for 500 s), and
    a file past the progress size says that it is being read (a line where stderr is no terminal)."""
    from distlab.data import sft
    from tests.conftest import invoke
    _pairs(tmp_path / "pairs.jsonl", 40)
    reads = []
    original = sft.objects
    monkeypatch.setattr(sft, "objects", lambda path, progress=False: (reads.append(path), original(path, progress))[1])
    monkeypatch.setattr(sft, "PROGRESS_BYTES", 100)
    code, out, err = invoke(["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                             "--block-size", "24", "--global-batch-size", "4", "--max-steps", "1", "--no-progress",
                             "--dataset", f"dpo:{tmp_path / 'pairs.jsonl'}", "--out", str(tmp_path / "run")], tmp_path)
    assert code == 0, err
    assert len(reads) == 1, reads
    assert err.count(f"distlab: reading 0 MiB of records from {tmp_path / 'pairs.jsonl'}") == 1, err
