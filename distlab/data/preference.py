"""Preference pairs for direct preference optimisation (DPO): ``dpo:FILE.jsonl``, one JSON object per line,

* ``{"prompt": TEXT, "chosen": TEXT, "rejected": TEXT}``: two completions of one prompt, the first preferred;
* ``{"prompt": [MESSAGES], "chosen": [MESSAGES], "rejected": [MESSAGES]}``: a conversation and two replies
  (each a list holding the assistant's message), rendered by the model's chat template (``--tokenizer
  hf:DIR``, :mod:`distlab.data.chat`);
* ``{"chosen": [MESSAGES], "rejected": [MESSAGES]}``: two whole conversations that differ in their last
  reply (TRL's "implicit prompt": the conversation before it must render the same in both);

and ``synthetic-pairs[:N]``: ``N`` generated pairs (default 200), a chain of bytes followed by its
continuation (chosen) or by random bytes (rejected) -- what ``verify`` trains on.

A pair becomes two windows of ``block_size + 1`` tokens, each laid out as a fine-tuning record is
(:mod:`distlab.data.sft`: the prompt's tokens, the completion's and its end, padding; only the completion's
positions are targets). A sample is a pair: :meth:`PreferenceDataset.batch` of ``B`` pairs returns ``2B``
rows, the chosen completion of pair ``i`` at row ``2i`` and the rejected one at ``2i + 1`` -- so a
micro-batch, a data-parallel shard or a pipeline's micro-batch (which split rows in equal consecutive
runs of an even number) never separates a pair. The targets ``y`` are ``(2B, T, 2)`` float64: the target
token (or ``IGNORE_INDEX``) and the reference model's log-probability of it
(:attr:`PreferenceDataset.reference`, 0 until :mod:`distlab.train.preference` computed it) -- a context-
parallel rank cuts both along the sequence as it cuts the inputs.

Pair ``i`` (from 0, in file order) is in ``test`` when ``i % 10 == 9``, else in ``train``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from distlab.data import sft
from distlab.data import tokenizer as tokenizers
from distlab.data.text import TextDataset
from distlab.errors import ConfigError

PREFIX = "dpo:"
SYNTHETIC = re.compile(r"^synthetic-pairs(?::(\d+))?$")
SYNTHETIC_PAIRS = 200


def is_preference(name: str) -> bool:
    """Whether dataset ``name`` is preference pairs."""
    return name.startswith((PREFIX, "synthetic-pairs"))


def check_name(name: str) -> str:
    """``name`` where it names pairs that exist (a file), else one line saying what to give."""
    if name.startswith(PREFIX):
        path = Path(name[len(PREFIX):]).expanduser()
        if not path.is_file():
            raise ConfigError(f"--dataset {name}: no such file (give a .jsonl file of {{\"prompt\": ..., \"chosen\": "
                              f"..., \"rejected\": ...}} records, one per line)")
    else:
        synthetic_pairs(name)
    return name


def synthetic_pairs(name: str) -> int:
    m = SYNTHETIC.match(name)
    if not m or (m.group(1) is not None and int(m.group(1)) < sft.TEST_EVERY):
        raise ConfigError(f"bad preference set {name!r}: write synthetic-pairs or synthetic-pairs:N (N >= "
                          f"{sft.TEST_EVERY} pairs)")
    return int(m.group(1) or SYNTHETIC_PAIRS)


class Pair:
    """One preference: a prompt and two completions (``chat``: rendered by a template)."""

    def __init__(self, prompt: str, chosen: str, rejected: str, chat: bool = False):
        self.chosen = sft.Record.of(prompt, chosen, chat)
        self.rejected = sft.Record.of(prompt, rejected, chat)

    @property
    def alike(self) -> bool:
        """Its two completions are the same text: nothing to prefer (DPO's loss is log 2 and its gradient 0)."""
        return self.chosen == self.rejected


def _conversation(template, prompt, reply, where: str, which: str) -> tuple[str, str]:
    from distlab.data.chat import split_reply
    if not isinstance(reply, list):
        raise ConfigError(f"{where}: \"{which}\" of a chat pair is a list of messages (the assistant's reply)")
    return split_reply(template, [*prompt, *reply], f"{where} ({which})")


def pairs(spec: str, template=None, template_dir: str = "", progress: bool = False) -> list[Pair]:
    """Every line's pair, in file order; one line naming the first bad one (``progress``: :func:`sft.objects`')."""
    path, out = Path(spec[len(PREFIX):]).expanduser(), []
    for where, record in sft.objects(path, progress):
        if not (isinstance(record, dict) and "chosen" in record and "rejected" in record):
            raise ConfigError(f"{where}: a preference record is {{\"prompt\": TEXT, \"chosen\": TEXT, \"rejected\": "
                              f"TEXT}} (or the same with chat messages)")
        prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
        if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            out.append(Pair(prompt, chosen, rejected))
            continue
        if isinstance(prompt, str) or isinstance(chosen, str) or isinstance(rejected, str):
            raise ConfigError(f"{where}: \"prompt\", \"chosen\" and \"rejected\" are all text or all chat messages")
        sft.need_template(template, where, template_dir)
        head = prompt if isinstance(prompt, list) else []
        (p1, c), (p2, r) = (_conversation(template, head, chosen, where, "chosen"),
                            _conversation(template, head, rejected, where, "rejected"))
        if p1 != p2:
            raise ConfigError(f"{where}: the chosen and rejected conversations differ before their last reply; a "
                              f"pair answers one prompt (give it as \"prompt\")")
        out.append(Pair(p1, c, r, chat=True))
    if out and all(p.alike for p in out):
        raise ConfigError(f"{path}: in every pair the chosen completion is the rejected one: there is nothing to "
                          f"prefer (DPO learns from a chosen and a rejected answer that differ)")
    return sft.enough(out, path)


def read(spec: str, tokenizer: str = tokenizers.BYTES, progress: bool = False):
    """``(tokenizer, pairs)`` of ``spec`` read with ``--tokenizer`` (its chat template where it has one), once per
    process (:func:`distlab.data.sft.once`; ``progress``: a large file's reading shown)."""
    from distlab.data.chat import ChatTemplate
    if not spec.startswith(PREFIX):
        return sft.tokenizer_of(tokenizer), _generated(synthetic_pairs(spec))

    def make():
        template_dir = tokenizer[3:] if tokenizers.is_pretrained(tokenizer) else ""
        template = ChatTemplate.from_dir(template_dir) if template_dir else None
        return sft.tokenizer_of(tokenizer), pairs(spec, template, template_dir, progress)
    return sft.once(("dpo", spec, tokenizer), tokenizer, [Path(spec[len(PREFIX):]).expanduser()], make)


def _generated(n: int) -> list[Pair]:
    """``n`` pairs of bytes: a chain's first 3 to 5 bytes, then 2 to 5 more of it (chosen) or random ones."""
    rng = np.random.default_rng(0)
    successor = rng.permutation(96) + 32  # printable bytes, each with one successor
    out = []
    for _ in range(n):
        chain = [int(rng.integers(32, 128))]
        for _ in range(10):
            chain.append(int(successor[chain[-1] - 32]))
        split, end = int(rng.integers(2, 5)), int(rng.integers(2, 5))  # (at most 8 tokens: verify's windows)
        text = bytes(chain).decode()
        noise = bytes(rng.integers(32, 128, end).tolist()).decode()
        out.append(Pair(text[:split], text[split:split + end], noise))
    return out


@dataclass
class PreferenceDataset(TextDataset):
    """Pairs of windows (module docstring); ``reference`` (float32, per stream position): the reference
    model's log-probability of the token there, filled by :mod:`distlab.train.preference`."""

    reference: torch.Tensor | None = None
    positions: bool = False  # y's second column holds each target's place in the stream (to fill ``reference``)

    def __len__(self) -> int:
        return len(self.starts) // 2

    pairs = True  # a sample is a pair of windows
    inputs_per_sample = 2

    @property
    def ignores_targets(self) -> bool:
        return False  # the loss is a pair's, not a mean over kept targets (its own scaling)

    @staticmethod
    def rows(indices: torch.Tensor) -> torch.Tensor:
        """The windows of pairs ``indices``: chosen, rejected, chosen, ..."""
        indices = torch.as_tensor(indices)
        return torch.stack([2 * indices, 2 * indices + 1], 1).flatten()

    def batch(self, indices, *, augment: bool = False, generator=None):
        """``(x, y)`` of pairs ``indices`` (module docstring)."""
        rows = self.rows(torch.as_tensor(indices).to(self.tokens.device))
        x, target = super().batch(rows)
        where = self._starts(rows)[:, None] + torch.arange(1, self.block_size + 1, device=self.tokens.device)
        second = where.double() if self.positions else (
            self.reference[where].double() if self.reference is not None else torch.zeros(where.shape,
                                                                                       dtype=torch.float64))
        return x, torch.stack([target.double(), second.to(target.device)], -1)

    def with_positions(self) -> "PreferenceDataset":
        """The same pairs whose ``y`` holds each target's place in the stream (to fill ``reference`` by)."""
        return replace(self, positions=True)

    def subset(self, indices: torch.Tensor, split: str) -> "PreferenceDataset":
        return replace(self, split=split, starts=self._starts(self.rows(indices).to(self.tokens.device)))

    def to(self, device) -> "PreferenceDataset":
        moved = super().to(device)
        return replace(moved, reference=self.reference.to(device) if self.reference is not None else None)


def load_pairs(spec: str, split: str, block_size: int, tokenizer: str = tokenizers.BYTES) -> PreferenceDataset:
    """The ``split`` of ``spec`` as pairs of windows (module docstring)."""
    tok, every = read(spec, tokenizer)
    mine = [p for i, p in enumerate(every) if (i % sft.TEST_EVERY == sft.TEST_EVERY - 1) == (split == "test")]
    alike = sum(p.alike for p in mine)  # pairs that teach nothing: dropped, and said
    mine = [p for p in mine if not p.alike]
    if not mine:
        raise ConfigError(f"{spec}: in every {split} pair the chosen completion is the rejected one: there is "
                          f"nothing to prefer (give pairs whose answers differ)")
    width = block_size + 1
    stream = np.zeros(2 * len(mine) * width, dtype=np.int64)
    ignored = np.ones(len(stream), dtype=bool)
    cut = scored = empty = completion_tokens = completion_bytes = 0
    for n, record in enumerate(r for p in mine for r in (p.chosen, p.rejected)):
        ids, targets = sft.encode(tok, record)
        completion_tokens += sum(targets)
        completion_bytes += len(record.scored.encode())
        cut += len(ids) > width
        ids, targets = ids[:width], targets[:width]
        scored += sum(targets)
        empty += not any(targets)
        stream[n * width:n * width + len(ids)] = ids
        ignored[n * width:n * width + len(ids)] = ~np.asarray(targets, dtype=bool)
    if empty:
        raise ConfigError(f"{spec}: {empty:,} {split} completions are left with no token in the window of "
                          f"`block_size` {block_size} + 1 tokens (their prompt fills it): raise `block_size`")
    data = PreferenceDataset(spec, split, torch.from_numpy(stream), block_size,
                             torch.arange(2 * len(mine)) * width, spec[len(PREFIX):] if spec.startswith(PREFIX)
                             else "generated", tok.vocab_size, tokenizer=tok if tok.sha256 else None,
                             ignored=torch.from_numpy(ignored), records=True,
                             tokens_per_byte=completion_tokens / completion_bytes if completion_bytes else 1.0)
    chats = sum(p.chosen.chat for p in mine)
    data.about = (f"{len(mine):,} preference pairs, each completion one window padded to {width} tokens, the loss "
                  f"DPO's on their {scored:,} completion tokens" + (f"; {cut:,} completion{'s' if cut != 1 else ''} cut at the window's end"
                                                                     if cut else "")
                  + (f"; {chats:,} chat pairs rendered by the chat template" if chats else "")
                  + (f"; {alike:,} pair{'s' if alike != 1 else ''} whose chosen completion is the rejected one "
                     f"dropped (nothing to prefer)" if alike else ""))
    return data


def shape(spec: str, block_size: int, tokenizer: str) -> tuple[tuple[int, ...], int]:
    return (block_size,), sft.tokenizer_of(tokenizer).vocab_size
