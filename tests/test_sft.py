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
