"""Prompts for reinforcement learning from rewards (GRPO, :mod:`distlab.train.grpo`): ``rl:FILE.jsonl``, one JSON
object per line,

* ``{"prompt": TEXT, ...}``: a prompt the policy completes;
* ``{"messages": [MESSAGES], ...}``: a conversation the policy replies to, rendered by the model's chat template
  with its generation prompt (``--tokenizer hf:DIR``, :mod:`distlab.data.chat`);

with whatever other fields the rewards read (``"answer"`` for the built-in ones, :mod:`distlab.train.rewards`) --
and ``synthetic-rl[:N]``: ``N`` generated sums (default 400), ``"a+b="`` with its ``"answer"``, what ``verify``
and the tests train on.

A sample is a prompt: :meth:`PromptDataset.batch` of ``B`` prompts gives ``x`` ``(B, T)``, each prompt's tokens
from the window's start (then zeros), and ``y`` ``(B, 2)``: the prompt's record number and its length. The
rollout (:mod:`distlab.train.rollout`) turns them into ``B x group_size`` completions to train on. A completion
ends at the tokenizer's end of sequence or of turn; with bytes, which have none, at a newline.

Record ``i`` (from 0, in file order) is in ``test`` when ``i % 10 == 9``, else in ``train``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from distlab.data import sft
from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError

PREFIX = "rl:"
SYNTHETIC = re.compile(r"^synthetic-rl(?::(\d+))?$")
SYNTHETIC_PROMPTS = 400
NEWLINE = 10  # where a byte-level completion ends


def is_rl(name: str) -> bool:
    """Whether dataset ``name`` is prompts to learn from rewards on."""
    return name.startswith((PREFIX, "synthetic-rl"))


def check_name(name: str) -> str:
    """``name`` where it names prompts that exist (a file), else one line saying what to give."""
    if name.startswith(PREFIX):
        if not Path(name[len(PREFIX):]).expanduser().is_file():
            raise ConfigError(f"--dataset {name}: no such file (give a .jsonl file of {{\"prompt\": ..., \"answer\": "
                              f"...}} records, one per line)")
    else:
        synthetic_count(name)
    return name


def synthetic_count(name: str) -> int:
    m = SYNTHETIC.match(name)
    if not m or (m.group(1) is not None and int(m.group(1)) < sft.TEST_EVERY):
        raise ConfigError(f"bad prompt set {name!r}: write synthetic-rl or synthetic-rl:N (N >= {sft.TEST_EVERY} "
                          f"prompts)")
    return int(m.group(1) or SYNTHETIC_PROMPTS)


def _generated(n: int) -> list[dict]:
    """``n`` sums of two numbers below 50, each with its answer."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        a, b = (int(v) for v in rng.integers(0, 50, 2))
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return out


def records(spec: str, template=None, template_dir: str = "") -> list[tuple[str, dict]]:
    """``(prompt text, record)`` of every line, in file order (chat prompts rendered by ``template`` with its
    generation prompt); one line naming the first bad one."""
    if not spec.startswith(PREFIX):
        return [(r["prompt"], r) for r in _generated(synthetic_count(spec))]
    path, out = Path(spec[len(PREFIX):]).expanduser(), []
    for where, record in sft.objects(path):
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            out.append((record["prompt"], record))
        elif isinstance(record, dict) and isinstance(record.get("messages"), list) and "prompt" not in record:
            sft.need_template(template, where, template_dir)
            from distlab.data.chat import check_messages
            check_messages(record["messages"], where)
            out.append((template.render(record["messages"], add_generation_prompt=True), record))
        else:
            raise ConfigError(f"{where}: a prompt record is {{\"prompt\": TEXT, ...}} or {{\"messages\": [{{\"role\": "
                              f"..., \"content\": TEXT}}, ...], ...}}, with the fields its rewards read")
    return sft.enough(out, path)


@dataclass
class PromptDataset:
    """The prompts of one split (module docstring): ``prompts[i]`` record ``i``'s token ids, ``fields[i]`` the
    record itself (what rewards read), ``stops`` the tokens that end a completion."""

    name: str
    split: str
    prompts: list[list[int]]
    fields: list[dict]
    block_size: int
    vocab_size: int
    stops: frozenset[int]
    tokenizer: object = None
    source: str = ""
    about: str = ""
    index: torch.Tensor | None = None  # the records this set holds (a subset's), by number
    device: str = "cpu"
    extra: dict = field(default_factory=dict)

    predicts_tokens = True
    ignores_targets = False
    augment = False
    inputs_per_sample = 1
    pairs = False

    def __post_init__(self):
        if self.index is None:
            self.index = torch.arange(len(self.prompts))

    def __len__(self) -> int:
        return len(self.index)

    @property
    def input_shape(self) -> tuple[int]:
        return (self.block_size,)

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    def batch(self, indices, *, augment: bool = False, generator=None):
        """``(x, y)`` of prompts ``indices`` (module docstring)."""
        numbers = self.index[torch.as_tensor(indices, dtype=torch.long).cpu()]
        x = torch.zeros(len(numbers), self.block_size, dtype=torch.long)
        for row, n in enumerate(numbers.tolist()):
            ids = self.prompts[n][:self.block_size]
            x[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths = torch.tensor([min(len(self.prompts[n]), self.block_size) for n in numbers.tolist()])
        return x.to(self.device), torch.stack([numbers, lengths], 1).to(self.device)

    def subset(self, indices: torch.Tensor, split: str) -> "PromptDataset":
        return replace(self, split=split, index=self.index[torch.as_tensor(indices, dtype=torch.long).cpu()])

    def to(self, device) -> "PromptDataset":
        return replace(self, device=str(device))


def load_prompts(spec: str, split: str, block_size: int, tokenizer: str = tokenizers.BYTES) -> PromptDataset:
    """The ``split`` of ``spec`` as prompts (module docstring)."""
    from distlab.data.chat import ChatTemplate
    tok = sft.tokenizer_of(tokenizer)
    template_dir = tokenizer[3:] if tokenizers.is_pretrained(tokenizer) else ""
    template = ChatTemplate.from_dir(template_dir) if template_dir else None
    every = records(spec, template, template_dir)
    mine = [r for i, r in enumerate(every) if (i % sft.TEST_EVERY == sft.TEST_EVERY - 1) == (split == "test")]
    chat = [text for text, record in mine if "messages" in record]
    prompts = [(list(tok.begin) if "messages" not in record else []) + tok.encode(text.encode("utf-8")).tolist()
               for text, record in mine]
    full = sum(len(p) >= block_size for p in prompts)
    if full == len(prompts):
        raise ConfigError(f"{spec}: every {split} prompt fills the window of `block_size` {block_size} tokens, leaving "
                          f"no room for a completion: raise `block_size`")
    stops = frozenset(tok.stops) or frozenset({NEWLINE})
    about = (f"{len(prompts):,} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, completed in the "
             f"window of {block_size}" + (f"; {len(chat):,} chat prompts rendered by the chat template" if chat else "")
             + (f"; {full:,} filling the window (no room to complete: they are cut)" if full else ""))
    return PromptDataset(spec, split, prompts, [record for _, record in mine], block_size, tok.vocab_size, stops,
                         tokenizer=tok, source=spec[len(PREFIX):] if spec.startswith(PREFIX) else "generated",
                         about=about)


def shape(spec: str, block_size: int, tokenizer: str) -> tuple[tuple[int, ...], int]:
    return (block_size,), sft.tokenizer_of(tokenizer).vocab_size
