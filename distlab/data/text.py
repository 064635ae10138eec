"""Text for next-token prediction: the ``fortunes`` corpus and ``synthetic-text[:N]``.

Tokens are bytes by default (a vocabulary of 256: UTF-8 text needs no tokenizer and has nothing
out of vocabulary), or a byte-level BPE learned from the training split (``--tokenizer bpe:N``,
:mod:`distlab.data.tokenizer`). A split's text is one token stream cut into windows of ``block_size + 1`` tokens,
each starting ``block_size`` after the one before, so an epoch predicts every token of the stream
(but the first) once. A sample is a window: the input is its first ``block_size`` tokens, the
targets the same tokens shifted by one.

**fortunes** is Debian's ``fortunes`` package (``apt-get install fortunes``): English quotations,
jokes and verse in ``/usr/share/games/fortunes``, one file per topic, each with a ``.dat`` index
beside it. A fortune is the text between lines holding only ``%``. The split rule: taking the
topic files in name order and their fortunes in file order, fortune number ``i`` (from 0) is in the
validation split (``test``) when ``i % 10 == 9``, otherwise in ``train`` -- a tenth, interleaved
through every topic, so both splits cover all of them. Fortunes are joined with ``"\\n%\\n"`` as on
disk.

**synthetic-text[:N][:masked=F]** (``N`` training tokens, default 200,000; a tenth as many for
``test``; ``masked=F``: a seeded share ``F`` of the positions is no target -- ``IGNORE_INDEX``, as a
fine-tuning set's prompt tokens --, so the loss is a mean over the kept targets) is a seeded stream from a random first-order Markov chain: each byte is followed by one of 8 bytes
chosen for it, with probabilities 1/2, 1/4, ... -- about 1.4 nats per token of conditional entropy
against ~5.4 for the unigram distribution, so a model must learn from context to beat the
baseline, and can.

:attr:`TextDataset.unigram_entropy` (nats per token) is the loss of the best model that ignores
context: the baseline to beat.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from distlab.errors import ConfigError
from distlab.models import IGNORE_INDEX
from distlab.models.packing import Packed

VOCAB = 256
SYNTHETIC = re.compile(r"^synthetic-text(?::(\d+))?(?::masked=(0(?:\.\d+)?|1(?:\.0*)?|\.\d+))?$")
SYNTHETIC_TRAIN = 200_000
FORTUNES_SYSTEM_DIR = "/usr/share/games/fortunes"
VALIDATION_EVERY = 10  # fortune i is validation when i % 10 == 9
SEPARATOR = b"\n%\n"


@dataclass
class TextDataset:
    """A token stream seen as windows of ``block_size + 1`` tokens starting at ``starts`` (None: the
    ``windows`` of a whole split, window ``i`` at ``i x block_size``, held as no tensor).

    ``tokenizer`` made the stream (:mod:`distlab.data.tokenizer`: bytes by default, a vocabulary of
    ``num_classes``); ``tokens_per_byte`` is its rate on this split's text (1 for bytes).
    """

    name: str
    split: str
    tokens: torch.Tensor
    block_size: int
    starts: torch.Tensor | None
    source: str = ""
    num_classes: int = VOCAB
    augment: bool = False
    tokenizer: object = None
    tokens_per_byte: float | None = 1.0  # None: unknown (a corpus of token ids without its tokenizer)
    entropy: float | None = None  # the unigram entropy when known without counting (a prepared corpus's manifest)
    windows: int = 0  # how many, when ``starts`` is None
    ignored: torch.Tensor | None = None  # per stream position: the token there is no target (IGNORE_INDEX)
    mapped: bool = False  # ``tokens`` is a memory-mapped file's (a prepared corpus): read from disk, not held
    records: bool = False  # each window one record (fine-tuning), not a stretch of a stream of documents
    about: str = ""  # what the run's header adds about how the windows were made (fine-tuning records: padding)
    record_starts: torch.Tensor | None = None  # per stream position: a packed record starts there (--pack)

    pairs = False  # a sample is one window (a preference pair's two: distlab.data.preference)
    inputs_per_sample = 1  # model inputs a sample is

    @property
    def predicts_tokens(self) -> bool:
        """Whether a sample's targets are a sequence of tokens (yes: the next token at every position)."""
        return True

    @property
    def ignores_targets(self) -> bool:
        """Whether some targets are :data:`~distlab.models.IGNORE_INDEX` (not scored, not learned)."""
        return self.ignored is not None

    @classmethod
    def from_tokens(cls, name: str, split: str, tokens: torch.Tensor, block_size: int, source: str,
                    tokenizer=None, text_bytes: int | None = None, vocab: int | None = None) -> "TextDataset":
        if block_size < 1:
            raise ConfigError(f"`block_size` must be positive, not {block_size}")
        windows = (len(tokens) - 1) // block_size
        if windows < 1:
            raise ConfigError(f"the {split} split of {name} has {len(tokens):,} tokens: too few for one window of "
                              f"--block-size {block_size} + 1")
        vocab = vocab or (tokenizer.vocab_size if tokenizer is not None else VOCAB)
        rate = len(tokens) / text_bytes if text_bytes else 1.0
        return cls(name, split, tokens, block_size, None, source, vocab, tokenizer=tokenizer, tokens_per_byte=rate,
                   windows=windows)

    def __len__(self) -> int:
        return len(self.starts) if self.starts is not None else self.windows

    def _starts(self, indices: torch.Tensor) -> torch.Tensor:
        return self.starts[indices] if self.starts is not None else indices * self.block_size

    @property
    def input_shape(self) -> tuple[int]:
        return (self.block_size,)

    def batch(self, indices: torch.Tensor, *, augment: bool = False,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """``(inputs, targets)`` of windows ``indices``, each ``(B, block_size)``; packed, ``(inputs, targets,
        structure)`` (a :class:`~distlab.models.packing.Packed`: each token's position in its record, each
        position's record)."""
        device = self.tokens.device
        indices = torch.as_tensor(indices).to(device, non_blocking=True)
        offsets = self._starts(indices)[:, None] + torch.arange(self.block_size + 1, device=device)
        window = self.tokens[offsets].long()
        target = window[:, 1:]
        if self.ignored is not None:
            target = target.masked_fill(self.ignored[offsets[:, 1:]], IGNORE_INDEX)
        # contiguous: torch's pipelining checks strides against its own, and copies to a GPU go faster
        if self.record_starts is None:
            return window[:, :-1].contiguous(), target.contiguous()
        return window[:, :-1].contiguous(), target.contiguous(), Packed.of_starts(self.record_starts[offsets[:, :-1]])

    def to(self, device: torch.device | str) -> "TextDataset":
        """The same windows with the token stream on ``device`` (batches are then gathered there)."""
        tokens = self.tokens
        if tokens.dtype in (torch.uint16, torch.uint32):  # a prepared corpus's: widened in pieces to a type
            wide = torch.empty(len(tokens), dtype=torch.int32, device=device)  # every device indexes
            for i in range(0, len(tokens), 1 << 24):
                wide[i:i + (1 << 24)] = tokens[i:i + (1 << 24)].to(torch.int32).to(device)
            tokens = wide
            return replace(self, tokens=tokens, mapped=False, **self._beside(device))
        return replace(self, tokens=tokens.to(device), **self._beside(device))

    def _beside(self, device) -> dict:
        """The per-window and per-position tensors beside the tokens, on ``device``."""
        return {name: t.to(device) if t is not None else None
                for name, t in (("starts", self.starts), ("ignored", self.ignored), ("record_starts", self.record_starts))}

    def subset(self, indices: torch.Tensor, split: str) -> "TextDataset":
        """The windows ``indices`` only (a validation split carved from the training windows)."""
        return replace(self, split=split, starts=self._starts(torch.as_tensor(indices).to(self.tokens.device)))

    @property
    def unigram_entropy(self) -> float:
        """Entropy of the token distribution of this split's stream, in nats per token: of its targets only
        where some are ignored (fine-tuning records: the completions', not the prompts' or the padding's)."""
        if self.entropy is not None:
            return self.entropy
        tokens = self.tokens.long().cpu()
        if self.ignored is not None:
            tokens = tokens[~self.ignored.cpu()]
        counts = torch.bincount(tokens, minlength=self.num_classes).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())


# --------------------------------------------------------------------------- fortunes


def fortune_files(directory: Path) -> list[Path]:
    """The fortune files of ``directory``: those with a ``.dat`` index beside them, in name order."""
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and p.suffix not in (".dat", ".u8") and p.with_name(p.name + ".dat").is_file())


def fortunes_present(directory: Path) -> bool:
    return directory.is_dir() and bool(fortune_files(directory))


def read_fortunes(directory: Path, split: str) -> np.ndarray:
    """The ``split`` ("train" or "test") token stream of the corpus in ``directory`` (uint8)."""
    pieces, i = [], 0
    for path in fortune_files(directory):
        text = path.read_bytes().replace(b"\r\n", b"\n")
        for fortune in re.split(rb"(?m)^%\n", text + b"\n"):
            fortune = fortune.strip(b"\n")
            if not fortune:
                continue
            if (i % VALIDATION_EVERY == VALIDATION_EVERY - 1) == (split == "test"):
                pieces.append(fortune)
            i += 1
    if not pieces:
        raise ConfigError(f"{directory}: no fortunes found in its fortune files")
    return np.frombuffer(SEPARATOR.join(pieces) + SEPARATOR, dtype=np.uint8).copy()


# --------------------------------------------------------------------------- synthetic-text


def parse_synthetic(spec: str) -> tuple[int, float]:
    """(training tokens, share of targets ignored) of ``synthetic-text[:N][:masked=F]``."""
    m = SYNTHETIC.match(spec)
    if not m or (m.group(1) is not None and int(m.group(1)) < 2):
        raise ConfigError(f"bad synthetic text {spec!r}: write synthetic-text, synthetic-text:TOKENS "
                          f"(e.g. synthetic-text:100000) or synthetic-text:TOKENS:masked=F (a share F of the "
                          f"targets ignored, between 0 and 1)")
    return int(m.group(1) or SYNTHETIC_TRAIN), float(m.group(2) or 0.0)


def make_synthetic_text(spec: str, split: str, seed: int, block_size: int) -> TextDataset:
    n_train, masked = parse_synthetic(spec)
    n = n_train if split == "train" else max(block_size + 1, n_train // 10)
    rng = np.random.default_rng(seed)                              # the chain: the same for both splits
    successors = np.stack([rng.choice(VOCAB, 8, replace=False) for _ in range(VOCAB)])
    probs = 0.5 ** np.arange(1, 9)
    probs /= probs.sum()
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])
    picks = rng.choice(8, size=n, p=probs)
    stream = np.empty(n, dtype=np.uint8)
    token = int(rng.integers(VOCAB))
    for i in range(n):
        stream[i] = token
        token = int(successors[token, picks[i]])
    data = TextDataset.from_tokens(spec, split, torch.from_numpy(stream), block_size, "generated")
    if masked:  # a seeded share of the positions is no target, as a fine-tuning prompt's tokens are not
        data = replace(data, ignored=torch.from_numpy(rng.random(n) < masked))
    return data


def conditional_entropy_of_synthetic() -> float:
    """Nats per token of the synthetic chain (the loss a perfect model reaches)."""
    probs = 0.5 ** np.arange(1, 9)
    probs /= probs.sum()
    return float(-(probs * np.log(probs)).sum())


__all__ = ["TextDataset", "fortune_files", "fortunes_present", "make_synthetic_text", "read_fortunes",
           "conditional_entropy_of_synthetic", "FORTUNES_SYSTEM_DIR", "VOCAB"]
