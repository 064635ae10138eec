"""Supervised fine-tuning records: ``sft:FILE.jsonl``, one JSON object per line with a ``prompt`` and a
``completion`` (text).

Each record becomes one window of ``block_size + 1`` tokens: the prompt's tokens, the completion's, the
tokenizer's end-of-sequence token where it has one (so the model learns to stop), then padding. Only the
completion's tokens and the end of sequence are targets: the prompt's positions and the padding are
:data:`~distlab.models.IGNORE_INDEX`, so the loss is the mean over the completion tokens of the global
batch -- on every layout (the ignored targets are honoured by the vocabulary-parallel loss, the pipeline's
last stage and context parallel's chunks alike). A record longer than the window is cut at its end (the
count is reported). Records are padded one per window, not packed: no record sees another.

Record ``i`` (from 0, in file order) is in ``test`` when ``i % 10 == 9``, else in ``train``. Tokens are
bytes by default, or a pretrained model's (``--tokenizer hf:DIR``: its ``tokenizer.json``). Chat records
(``messages``) need the model's chat template, which is not rendered yet: they are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError

PREFIX = "sft:"
TEST_EVERY = 10


def path_of(spec: str) -> Path:
    path = Path(spec[len(PREFIX):]).expanduser()
    if not path.is_file():
        raise ConfigError(f"--dataset {spec}: no such file (give a .jsonl file of {{\"prompt\": ..., \"completion\": ...}} "
                          f"records, one per line)")
    return path


def tokenizer_of(spec: str):
    """bytes, or a pretrained model's tokenizer (``hf:DIR``)."""
    if tokenizers.is_pretrained(spec):
        return tokenizers.HFTokenizer.from_dir(spec[3:])
    if spec != tokenizers.BYTES:
        raise ConfigError(f"--dataset sft: reads its records with bytes or a pretrained model's tokenizer (hf:DIR), "
                          f"not {spec}")
    return tokenizers.ByteTokenizer()


def records(spec: str) -> list[tuple[str, str]]:
    """``(prompt, completion)`` of every line, in file order; one line naming the first bad one."""
    path, out = path_of(spec), []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: not a JSON object ({exc})") from None
            if isinstance(record, dict) and "messages" in record and "prompt" not in record:
                raise ConfigError(f"{path}:{number}: chat records (messages) need the model's chat template, which "
                                  f"distlab does not render yet: give prompt/completion records")
            if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                    and isinstance(record.get("completion"), str)):
                raise ConfigError(f"{path}:{number}: a record is {{\"prompt\": TEXT, \"completion\": TEXT}}")
            out.append((record["prompt"], record["completion"]))
    if len(out) < TEST_EVERY:
        raise ConfigError(f"{path} has {len(out)} records: every {TEST_EVERY}th is held out for testing, so give at "
                          f"least {TEST_EVERY}")
    return out


def load_sft(spec: str, split: str, block_size: int, tokenizer: str = tokenizers.BYTES):
    """The ``split`` of ``spec`` as windows, one record each (module docstring)."""
    from distlab.data.text import TextDataset
    tok = tokenizer_of(tokenizer)
    mine = [r for i, r in enumerate(records(spec)) if (i % TEST_EVERY == TEST_EVERY - 1) == (split == "test")]
    width = block_size + 1
    stream = np.zeros(len(mine) * width, dtype=np.int64)
    ignored = np.ones(len(mine) * width, dtype=bool)
    cut = scored = empty = 0
    end = [tok.eos] if getattr(tok, "eos", None) is not None else []
    for n, (prompt, completion) in enumerate(mine):
        head = tok.encode(prompt.encode("utf-8")).tolist()
        tail = tok.encode(completion.encode("utf-8")).tolist() + end
        ids = (head + tail)[:width]
        cut += len(head) + len(tail) > width
        at = n * width
        stream[at:at + len(ids)] = ids
        ignored[at + len(head):at + len(ids)] = False  # the completion's tokens (and the end) are targets
        scored += max(0, len(ids) - max(len(head), 1))
        empty += len(head) >= width  # the prompt fills the window: nothing of the completion is left
    if empty == len(mine):
        raise ConfigError(f"{spec}: every {split} record's prompt fills the window of `block_size` {block_size} + 1 "
                          f"tokens, leaving no completion token to learn: raise `block_size`")
    data = TextDataset(spec, split, torch.from_numpy(stream), block_size,
                       torch.arange(len(mine)) * width, str(path_of(spec)), tok.vocab_size,
                       tokenizer=tok if tok.sha256 else None, ignored=torch.from_numpy(ignored))
    data.about = describe(len(mine), scored, cut, block_size) + \
        (f"; {empty:,} with no completion token left (their prompt fills the window)" if empty else "")
    return data


def shape(spec: str, block_size: int, tokenizer: str) -> tuple[tuple[int, ...], int]:
    return (block_size,), tokenizer_of(tokenizer).vocab_size


def describe(n: int, scored: int, cut: int, block_size: int) -> str:
    """The header's words: records, padding, targets, truncation."""
    return (f"{n:,} records, one per window padded to {block_size + 1} tokens (not packed), the loss on their "
            f"{scored:,} completion tokens" + (f"; {cut:,} cut at the window's end" if cut else ""))
