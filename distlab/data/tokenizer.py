"""Tokenizers for text: ``bytes`` (the default) and ``bpe:N``, a byte-level BPE trained on the training split.

``bytes``: a token is a byte of the UTF-8 text (a vocabulary of 256, nothing out of vocabulary,
no training). ``bpe:N``: byte-level byte-pair encoding (GPT-2's scheme) with a vocabulary of ``N``
tokens, learned from the training split alone with Hugging Face's ``tokenizers`` -- the 256
bytes first, then the most frequent adjacent pair merged into a new token until there are ``N``
(fewer if the text runs out of pairs seen twice; the model's vocabulary is ``N`` either way, so
its shape is known before any text is read). Training is deterministic: every rank, and every
restart, trains the same tokenizer from the same text, and a run keeps it beside its outputs
(``OUT/tokenizer.json``) and in its snapshots, so ``distlab generate`` and a resume use that one.

Text is read as UTF-8 (a byte that is not UTF-8 becomes U+FFFD for BPE; ``bytes`` keeps it).
``tokens_per_byte`` of a split turns a loss per token into a loss per byte, the measure that
compares tokenizers: ``nats/byte = nats/token x tokens/byte``.
"""

from __future__ import annotations

import functools
import hashlib
import re

import numpy as np

from distlab.errors import ConfigError, first_line

BYTES = "bytes"
_BPE = re.compile(r"^bpe:(\d+)$")
MIN_BPE, MAX_BPE = 257, 1 << 20
INSTALL = "pip install tokenizers"


def parse(spec: str) -> int | None:
    """``bytes`` -> None; ``bpe:N`` -> N; anything else a ConfigError saying what to write."""
    if spec == BYTES:
        return None
    m = _BPE.match(spec or "")
    if not m or not MIN_BPE <= int(m.group(1)) <= MAX_BPE:
        raise ConfigError(f"unknown `tokenizer` {spec!r}: write bytes, or bpe:N with N from {MIN_BPE} to {MAX_BPE:,} "
                          f"(the vocabulary size, e.g. bpe:4096)")
    return int(m.group(1))


def vocab_size(spec: str) -> int:
    """The model's vocabulary under tokenizer ``spec`` (known without reading any text)."""
    if is_pretrained(spec):
        return HFTokenizer.from_dir(spec[3:]).vocab_size
    n = parse(spec)
    return 256 if n is None else n


class ByteTokenizer:
    """A token per byte."""

    spec = BYTES
    vocab_size = 256
    sha256 = None
    begin: tuple[int, ...] = ()  # what starts a text (a pretrained tokenizer's BOS): nothing
    eos = eos_token = None  # no end-of-sequence token (a pretrained tokenizer's: HFTokenizer)
    stops: frozenset[int] = frozenset()  # where generation ends

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def stop_texts(self) -> tuple[str, ...]:
        return ()

    def to_json(self) -> None:
        return None


class IdsTokenizer:
    """No tokenizer, the ids themselves (a corpus of token ids without its tokenizer, nanoGPT's train.bin):
    the text is ids separated by white space, each below ``vocab_size``."""

    spec = "ids"
    sha256 = None
    learned = 0
    begin: tuple[int, ...] = ()
    eos = eos_token = None
    stops: frozenset[int] = frozenset()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, data: bytes) -> np.ndarray:
        words = data.decode("utf-8", errors="replace").split()
        if not all(w.isdigit() and int(w) < self.vocab_size for w in words):
            raise ConfigError(f"this model reads token ids (its run's corpus has no tokenizer): give --prompt as ids "
                              f"below {self.vocab_size:,} separated by spaces, e.g. --prompt '464 2068'")
        return np.asarray([int(w) for w in words], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(f" {int(i)}" for i in ids)

    def to_json(self) -> None:
        return None


class BPETokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (Hugging Face ``tokenizers``), saved as its JSON."""

    begin: tuple[int, ...] = ()
    eos = eos_token = None
    stops: frozenset[int] = frozenset()

    def __init__(self, tokenizer, vocab_size: int):
        self._tok = tokenizer
        self.vocab_size = vocab_size
        self.spec = f"bpe:{vocab_size}"
        self._json = tokenizer.to_str()
        self.sha256 = hashlib.sha256(self._json.encode()).hexdigest()

    @property
    def learned(self) -> int:
        """Tokens it actually has (at most ``vocab_size``)."""
        return self._tok.get_vocab_size()

    def stop_texts(self) -> tuple[str, ...]:
        """The text of each token generation stops at (``<|eot_id|>``, ``<|im_end|>`` ...), longest first."""
        return tuple(sorted({t for t in map(self._tok.id_to_token, self.stops) if t}, key=lambda t: (-len(t), t)))

    def encode(self, data: bytes) -> np.ndarray:
        text = data.decode("utf-8", errors="replace")
        # line by line, as it was trained (a token never spans a line break); decode(encode(t)) == t
        pieces = self._tok.encode_batch(text.splitlines(keepends=True)) if text else []
        ids = [i for enc in pieces for i in enc.ids]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_json(self) -> str:
        return self._json

    @classmethod
    def from_json(cls, text: str, vocab_size: int | None = None, where: str = "the tokenizer") -> "BPETokenizer":
        Tokenizer = _library().Tokenizer
        try:
            tok = Tokenizer.from_str(text)
        except Exception as exc:  # the library raises its own Exception types for a bad file
            raise ConfigError(f"{where} is not a tokenizer file of Hugging Face tokenizers ({first_line(exc, 160)})") \
                from None
        return cls(tok, max(vocab_size or 0, tok.get_vocab_size()))


class HFTokenizer(BPETokenizer):
    """A pretrained model's own tokenizer: its ``tokenizer.json`` (Hugging Face ``tokenizers``, any model:
    BPE, SentencePiece-style, WordPiece), the text encoded whole and without the special tokens a
    template would add; its vocabulary the model's (``config.json``'s ``vocab_size`` where it pads the
    tokenizer's), its end-of-sequence token what separates documents."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None, stops: frozenset[int] = frozenset(),
                 eos_token: int | None = None):
        super().__init__(tokenizer, vocab_size)
        self.spec, self.eos = "hf", eos
        # what the tokenizer's post-processor puts before a text (Llama's <|begin_of_text|>, Mistral's <s>): a
        # text the model reads starts with it, as transformers' tokenizer(text) gives it
        plain, special = (tokenizer.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        self.begin = next((tuple(special[:i]) for i in range(len(special) - len(plain) + 1)
                           if special[i:i + len(plain)] == plain), ())
        self.eos_token = eos if eos_token is None else eos_token  # tokenizer_config.json's eos_token: a chat's end
        self.stops = stops | ({eos} if eos is not None else set())  # where generation ends (end of turn, of text)

    def encode(self, data: bytes) -> np.ndarray:
        text = data.decode("utf-8", errors="replace")
        ids = self._tok.encode(text, add_special_tokens=False).ids if text else []
        return np.asarray(ids, dtype=np.int64)

    def separator(self) -> np.ndarray:
        return np.asarray([self.eos], dtype=np.int64) if self.eos is not None else self.encode(b"\n")

    @classmethod
    def from_dir(cls, directory: str) -> "HFTokenizer":
        """``DIR/tokenizer.json`` with what ``DIR/config.json`` and ``DIR/tokenizer_config.json`` say of it."""
        from pathlib import Path

        from distlab.models.hf_files import read_json
        root, where = Path(directory), f"hf:{directory}"
        if not (root / "tokenizer.json").is_file():
            raise ConfigError(f"{where}: no tokenizer.json there (a model's tokenizer in Hugging Face "
                              f"tokenizers' format; a tokenizer.model of SentencePiece alone is not read)")
        spec = read_json(root / "tokenizer.json", where)  # text, JSON, an object, of bounded depth
        config, tok_config, gen_config = (
            {} if not (root / f).is_file() else read_json(root / f, where)
            for f in ("config.json", "tokenizer_config.json", "generation_config.json"))
        return cls.from_files(spec, config, tok_config, gen_config, where)

    @classmethod
    def from_files(cls, spec: dict, config: dict, tok_config: dict, gen_config: dict,
                   where: str) -> "HFTokenizer":
        """The tokenizer of a model's files as read (tokenizer.json's object; config.json's, tokenizer_config.json's
        and generation_config.json's): its vocabulary, end of text and every end generation stops at."""
        import json

        from distlab.models.hf_files import Config
        try:
            tok = _library().Tokenizer.from_str(json.dumps(spec))
        except Exception as exc:  # noqa: BLE001 - the library's own parse of someone else's file: one line
            raise ConfigError(f"{where}: tokenizer.json is not a tokenizer ({first_line(exc, 200)})") from None
        Config(config, where).size("vocab_size", 0, least=0)  # a whole number where it is given
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        word = tok_config.get("eos_token")
        word = word.get("content") if isinstance(word, dict) else word
        named = tok.token_to_id(word) if isinstance(word, str) and word else None
        eos = named if eos is None else eos
        # every end the model was made to stop at: a chat model's end of turn beside the end of text
        listed = [v for c in (config, gen_config) for v in (lambda e: e if isinstance(e, list) else [e])(
            c.get("eos_token_id")) if isinstance(v, int)]
        stops = frozenset(listed + ([named] if named is not None else []))
        return cls(tok, max(int(config.get("vocab_size") or 0), tok.get_vocab_size()), eos, stops, named)

    @classmethod
    def from_json(cls, text: str, vocab_size: int | None = None, where: str = "the tokenizer",
                  eos: int | None = None) -> "HFTokenizer":
        plain = BPETokenizer.from_json(text, vocab_size, where)
        return cls(plain._tok, plain.vocab_size, eos)


def _library():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"`tokenizer` bpe needs Hugging Face's tokenizers: {INSTALL}") from None
    return tokenizers


@functools.lru_cache(maxsize=4)
def train_bpe(text: bytes, vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of ``vocab_size`` tokens learned from ``text`` (deterministic)."""
    lines = text.decode("utf-8", errors="replace").splitlines(keepends=True)
    return train_bpe_lines(lines, vocab_size, len(lines))


def train_bpe_lines(lines, vocab_size: int, length: int | None = None) -> BPETokenizer:
    """:func:`train_bpe` from an iterable of text lines (``keepends``), read once: a corpus streamed from
    disk is never held whole (the trainer keeps its word counts)."""
    lib = _library()
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = lib.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(lines, trainer, length=length)
    return BPETokenizer(tok, vocab_size)


def is_pretrained(spec: str) -> bool:
    """``hf:DIR``: a pretrained model's tokenizer (:class:`HFTokenizer`)."""
    return isinstance(spec, str) and spec.startswith("hf:")


def build(spec: str, train_text: bytes) -> ByteTokenizer | BPETokenizer:
    """The tokenizer ``spec`` names, trained on ``train_text`` where it learns."""
    n = parse(spec)
    return ByteTokenizer() if n is None else train_bpe(train_text, n)


def load(path: str) -> ByteTokenizer | BPETokenizer:
    """A tokenizer file (``tokenizer.json`` beside a run or an exported model)."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--tokenizer {path}: {getattr(exc, 'strerror', None) or first_line(exc, 120)}") from None
    return BPETokenizer.from_json(text, where=f"--tokenizer {path}")


__all__ = ["BYTES", "BPETokenizer", "ByteTokenizer", "HFTokenizer", "IdsTokenizer", "is_pretrained", "build", "load", "parse", "train_bpe", "train_bpe_lines", "vocab_size"]
