"""Supervised fine-tuning records (``sft:FILE.jsonl``, distlab.data.sft): one record per window, the loss on
the completion's tokens only -- with and without tensor parallel's split vocabulary, the same step."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.data import load_dataset
from distlab.errors import ConfigError
from distlab.models import IGNORE_INDEX


def _records(path, n=30, long_at=None, prompt="Q: {i}+1? A: "):
    with open(path, "w") as f:
        for i in range(n):
            completion = "x" * 40 if i == long_at else f"{i + 1}"
            f.write(json.dumps({"prompt": prompt.format(i=i), "completion": completion}) + "\n")
    return f"sft:{path}"


def test_a_record_is_a_window_whose_targets_are_its_completion(tmp_path):
    spec = _records(tmp_path / "r.jsonl", long_at=3)
    train, test = (load_dataset(spec, s, block_size=16) for s in ("train", "test"))
    assert (len(train), len(test)) == (27, 3)  # record i is a test record when i % 10 == 9
    x, y = train.batch(torch.arange(len(train)))
    prompt = b"Q: 0+1? A: "
    assert bytes(x[0, :len(prompt)].tolist()) == prompt
    kept = y[0] != IGNORE_INDEX  # the target at t is token t + 1: the completion's, nothing else
    assert bytes(y[0][kept].tolist()) == b"1" and kept.sum() == 1 and y[0, len(prompt) - 1] == ord("1")
    assert (y[3] != IGNORE_INDEX).sum() == 16 - len(b"Q: 3+1? A: ") + 1  # a long record: cut at the window's end
    assert "27 records, one per window padded to 17 tokens (not packed)" in train.about and "1 cut" in train.about
    # the loss to beat is the completions' unigram entropy: the targets', not the prompts' or the padding's
    p = torch.bincount(y[y != IGNORE_INDEX]).double()
    p = p[p > 0] / p.sum()
    assert train.unigram_entropy == pytest.approx(float(-(p * p.log()).sum()), rel=1e-12)
    with pytest.raises(ConfigError, match="every train record's prompt fills the window of `block_size` 8"):
        load_dataset(spec, "train", block_size=8)


def test_bad_records_are_refused_in_one_line(tmp_path):
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 12)
    with pytest.raises(ConfigError, match="chat records \\(messages\\) are rendered by a model's chat template"):
        load_dataset(f"sft:{tmp_path / 'chat.jsonl'}", "train")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": 1}\n' * 6)
    with pytest.raises(ConfigError, match="bad.jsonl:2: a record is"):
        load_dataset(f"sft:{tmp_path / 'bad.jsonl'}", "train")


def test_fine_tuning_with_the_vocabulary_split_equals_one_process(tmp_path):
    """The loss over the completion tokens of the global batch: 2 ranks of tensor parallel (the
    vocabulary-parallel cross-entropy skipping the ignored targets) train the single-process model,
    within verify's float32 bound (data parallel's kept-target weighting: verify's +mask cases)."""
    from distlab.tools.verify import parse_strategy, verify
    spec = _records(tmp_path / "r.jsonl", prompt="{i}+1=")  # verify's windows are 8 tokens
    records = verify([parse_strategy("allreduce+tp=2")], 2, steps=2, timeout=300, model="llama", dataset=spec)
    assert all(r["passed"] for r in records), records


# A chat model's files as a Hugging Face directory holds them: a BPE with a begin, an end-of-text and an
# end-of-turn token; a Llama-3.1-style config listing both ends (the end of text first), a template that
# closes every turn with the end of turn.
CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|eot|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_model(path, template: str = CHAT, eos_token: str = "<|eot|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<|eot|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": eos_token,
                                                           "chat_template": template}))
    (path / "config.json").write_text(json.dumps({"vocab_size": 320, "eos_token_id": [1, 2]}))
    return tok


def _chats(path, n=20):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"the fox {i}?"},
                                                     {"role": "assistant", "content": "the lazy dog"}]}) + "\n"
                            for i in range(n)))
    return f"sft:{path}"


def test_chat_fine_tuning_starts_from_the_command_line_on_one_and_two_processes(run_cli, tmp_path):
    """`distlab train --dataset sft:CHATS --tokenizer hf:DIR`, as a user types it: the pre-launch check
    reads the records through the model's template (it refused them all), the targets are each reply and
    the template's end of turn -- no end of text after it --, the header names the template and offers no
    unigram baseline for a loss on the replies alone; tensor parallel's first loss is one process's."""
    from distlab.tools.verify import sum_tolerance
    tok = chat_model(tmp_path / "model")
    spec = _chats(tmp_path / "chat.jsonl")
    args = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--dataset", spec,
            "--tokenizer", f"hf:{tmp_path / 'model'}", "--block-size", "40", "--global-batch-size", "4",
            "--max-steps", "2", "--log-every", "1", "--no-progress"]
    one, two = (run_cli(*args, *extra, "--out", str(tmp_path / name), check=True)
                for name, extra in (("one", []), ("tp", ["--nproc-per-node", "2", "--tp", "2"])))
    targets = 18 * len(tok.encode("the lazy dog<|eot|>").ids)  # 18 train records: reply + end of turn
    for proc in (one, two):
        head = proc.stdout[:proc.stdout.index("step ")]
        assert f"the loss on their {targets:,} completion tokens" in head, head
        assert f"chat template of {tmp_path / 'model' / 'tokenizer_config.json'}" in head, head
        assert "loss to beat" not in head and "between documents" not in head, head
    first = [json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["loss"]
             for name in ("one", "tp")]
    # the same weights and batch: 40 positions x the widest dimension (320 logits) x 12 layers of terms, each
    # of at most the loss (~log 320) -- rounding only; a target lost or gained moves it by ~loss/72
    assert abs(first[0] - first[1]) <= sum_tolerance(40 * 320 * 12, 10.0), first
    # the run kept the template it read: `generate RUN --chat` asks its model the way it was tuned
    proc = run_cli("generate", str(tmp_path / "one"), "--chat", "--prompt", "the quick fox?", "--max-new-tokens", "3",
                   "--temperature", "0", check=True)
    assert "model file" in proc.stderr, proc.stderr


def test_a_chat_template_without_an_end_of_turn_ends_each_reply_with_the_tokenizers_eos_token(tmp_path):
    """A template that closes no turn: the reply is followed by tokenizer_config.json's ``eos_token`` (what
    the model emits to stop), not by config.json's first ``eos_token_id``."""
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
            "{% if add_generation_prompt %}assistant: {% endif %}"
    tok = chat_model(tmp_path / "model", template=plain)
    data = load_dataset(_chats(tmp_path / "chat.jsonl"), "train", block_size=40, tokenizer=f"hf:{tmp_path / 'model'}")
    x, y = data.batch(torch.arange(len(data)))
    assert y[0][y[0] != IGNORE_INDEX].tolist() == tok.encode("the lazy dog\n<|eot|>").ids


def test_every_assistant_reply_of_a_chat_trains_unless_the_last_alone_is_asked_for(run_cli, refused_here, tmp_path):
    """`distlab train` on two-reply chats: both replies (each with its end of turn) are targets, as the header
    counts them; `--chat-turns last` trains the last reply alone; the flag is refused for data that is not
    sft: records."""
    tok = chat_model(tmp_path / "model")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"the fox {i}?"}, {"role": "assistant", "content": "the lazy dog"},
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": "the quick fox"}]}) + "\n"
        for i in range(20)))
    args = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--dataset",
            f"sft:{tmp_path / 'chat.jsonl'}", "--tokenizer", f"hf:{tmp_path / 'model'}", "--block-size", "64",
            "--global-batch-size", "4", "--max-steps", "1", "--no-progress"]
    first, second = (len(tok.encode(f"{reply}<|eot|>").ids) for reply in ("the lazy dog", "the quick fox"))
    for extra, targets, words in (([], 18 * (first + second), "every assistant reply a target"),
                                  (["--chat-turns", "last"], 18 * second, "the last reply a target")):
        proc = run_cli(*args, *extra, "--out", str(tmp_path / f"run{len(extra)}"), check=True)
        head = proc.stdout[:proc.stdout.index("step ")]
        assert f"the loss on their {targets:,} completion tokens" in head and words in head, head
    proc = refused_here("train", "--dataset", "synthetic-text:2000", "--model", "gpt", "--chat-turns", "last")
    assert "--chat-turns chooses which replies" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
