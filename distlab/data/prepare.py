"""``distlab prepare-text SRC DIR [--tokenizer bytes|bpe:N]`` (:func:`prepare`): a text corpus of any
size tokenized once into the flat token files of ``tokens:DIR`` (:mod:`distlab.data.tokens` says what
the directory holds).

``SRC`` -- a text file or a directory of them, documents as ``text:PATH`` reads them
(:mod:`distlab.data.textfiles`: a file cut at blank lines, or one document per file, linked directories
followed; ``SRC/train`` and ``SRC/test`` as given) -- is streamed line by line, a long line a MiB at a
time, so no document is ever held whole. Documents are held out whole: document ``i`` (from 0, in
reading order) goes to ``test`` when ``i % 10 == 9``, decided as it starts. A BPE is learned from the
training documents alone, streamed to the trainer of Hugging Face's ``tokenizers``.

``DIR`` must be new or empty -- nothing there is overwritten -- and a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from distlab.data import text_documents
from distlab.data import tokenizer as tokenizers
from distlab.data.tokens import FORMAT, SPLITS, TEST_EVERY, atomic_text
from distlab.errors import ConfigError, WriteError


# --------------------------------------------------------------------------- reading the source


def documents(src: str | os.PathLike) -> Iterator[tuple[str, Iterator[bytes]]]:
    """(split, lines) of every document of ``src`` in reading order: held out as :data:`TEST_EVERY` says,
    or in the split its directory names."""
    root = Path(src)
    if not root.exists():
        raise ConfigError(f"prepare-text: there is no file or directory {root}")
    i = 0
    for split, doc in text_documents.documents(root, "prepare-text"):  # (text:PATH's reader too)
        if split is None:
            split = "test" if i % TEST_EVERY == TEST_EVERY - 1 else "train"
            i += 1
        yield split, doc


# --------------------------------------------------------------------------- writing the token files


class SplitWriter:
    """One split's token file, written in pieces, hashed and counted as it goes."""

    def __init__(self, path: Path, dtype: np.dtype, vocab: int):
        self.path, self.tmp, self.dtype = path, path.with_name(f".{path.name}.tmp"), dtype
        self.file = open(self.tmp, "wb")
        self.sha, self.tokens, self.bytes, self.documents = hashlib.sha256(), 0, 0, 0
        self.counts = np.zeros(vocab, dtype=np.int64)

    def write(self, ids: np.ndarray, text_bytes: int) -> None:
        data = ids.astype(self.dtype).tobytes()
        try:
            self.file.write(data)
        except OSError as exc:
            raise WriteError(self.tmp, exc) from None
        self.sha.update(data)
        self.tokens, self.bytes = self.tokens + len(ids), self.bytes + text_bytes
        self.counts += np.bincount(ids, minlength=len(self.counts))[:len(self.counts)]

    def abandon(self) -> None:
        """A failed preparation: close the temporary file (only then is its disk space given back) and remove it."""
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink(missing_ok=True)

    def close(self) -> dict:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            raise WriteError(self.path, exc) from None
        return {"file": self.path.name, "tokens": self.tokens, "documents": self.documents, "bytes": self.bytes,
                "sha256": self.sha.hexdigest()}


def unigram_entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / max(int(counts.sum()), 1)
    return float(-(p * np.log(p)).sum())


def dtype_for(vocab: int) -> np.dtype:
    """uint16 when every token id fits, else uint32."""
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def prepare(src: str | os.PathLike, out: str | os.PathLike, tokenizer: str = tokenizers.BYTES,
            progress: bool = True) -> dict:
    """Tokenize ``src`` into ``out`` (see the module's description); returns the manifest. ``out`` must be
    new or empty: nothing already there is overwritten, and a failure leaves nothing behind."""
    pretrained = tokenizers.HFTokenizer.from_dir(tokenizer[3:]) if tokenizers.is_pretrained(tokenizer) else None
    vocab_n = None if pretrained else tokenizers.parse(tokenizer)
    root, out = Path(src), Path(out)
    if not root.exists():
        raise ConfigError(f"prepare-text: there is no file or directory {root}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"prepare-text: {out} is a file, not a directory: give a new or empty directory for OUT")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:  # never a file it did not make: a nanoGPT directory's train.bin, another corpus, anything
        what = "a prepared corpus (its manifest.json)" if "manifest.json" in held else \
            f"{len(held)} entr{'ies' if len(held) > 1 else 'y'} ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
        raise ConfigError(f"prepare-text: {out} already holds {what}: prepare-text writes only into a new or empty "
                          f"directory, so nothing already there is overwritten or lost; give another OUT")
    total = sum(p.stat().st_size for _, p, _ in text_documents.sources(root))
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(out, exc, "give another directory") from None
    try:
        return _prepare(root, out, vocab_n, total, progress, pretrained)
    except BaseException:
        # nothing of a failed preparation stays: its files (finished or hidden temporaries, which on a full
        # disk would keep it full) and the directory it made
        for name in (*[f"{s}.bin" for s in SPLITS], *[f".{s}.bin.tmp" for s in SPLITS], "tokenizer.json",
                     ".tokenizer.json.tmp", "manifest.json", ".manifest.json.tmp"):
            with contextlib.suppress(OSError):
                (out / name).unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _prepare(root: Path, out: Path, vocab_n: int | None, total: int, progress: bool, pretrained=None) -> dict:
    from tqdm import tqdm

    tok = pretrained or tokenizers.ByteTokenizer()
    invalid = [0]  # bytes of the training text that are not UTF-8 (a BPE reads each as U+FFFD)
    if vocab_n is not None:  # a first pass learns the BPE from the training documents alone
        with tqdm(total=total, unit="B", unit_scale=True, desc="learning BPE", disable=not progress) as bar:
            def training_lines():  # the training split's lines, as the token file will hold them
                first = True
                for split, doc in documents(root):
                    if split == "train" and not first:
                        yield "\n"  # the blank line between documents
                    first = first and split != "train"
                    for line in doc:
                        bar.update(len(line))
                        if split == "train":
                            yield _text_of(line, invalid)
            tok = tokenizers.train_bpe_lines(training_lines(), vocab_n)
    vocab = tok.vocab_size
    dtype = dtype_for(vocab)
    writers = {s: SplitWriter(out / f"{s}.bin", dtype, vocab) for s in SPLITS}
    try:
        return _tokenize(root, out, tok, writers, total, progress, vocab_n, invalid[0])
    except BaseException:
        for w in writers.values():
            w.abandon()
        raise


def _text_of(line: bytes, invalid: list[int]) -> str:
    """``line`` as text, counting into ``invalid[0]`` the bytes that are not UTF-8 (each read as U+FFFD)."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        invalid[0] += len(line) - len(line.decode("utf-8", errors="ignore").encode("utf-8"))
        return line.decode("utf-8", errors="replace")


def _tokenize(root: Path, out: Path, tok, writers: dict, total: int, progress: bool, vocab_n: int | None,
              invalid: int) -> dict:
    from tqdm import tqdm

    vocab, dtype = tok.vocab_size, writers["train"].dtype
    separator = tok.separator() if hasattr(tok, "separator") else tok.encode(b"\n")  # a model's: its EOS
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        for split, doc in documents(root):
            w = writers[split]
            if w.documents:
                w.write(separator, 1)  # the blank line between documents
            if tok.begin:  # what the tokenizer puts before a text (a pretrained model's BOS) starts each document
                w.write(np.asarray(tok.begin, dtype=np.int64), 0)
            w.documents += 1
            batch, size = [], 0
            for line in doc:
                batch.append(line)
                size += len(line)
                if size >= 1 << 20:  # a MiB of text at a time: a document is never held whole
                    w.write(tok.encode(b"".join(batch)), size)
                    bar.update(size)
                    batch, size = [], 0
            if batch:
                w.write(tok.encode(b"".join(batch)), size)
                bar.update(size)
    splits = {s: w.close() for s, w in writers.items()}
    empty = [s for s in SPLITS if not splits[s]["documents"]]
    if empty:
        found = sum(splits[s]["documents"] for s in SPLITS)
        how = (f"{root} is a directory: each file in it is one document, its paragraphs not split -- {found} "
               f"document{'s' if found != 1 else ''} here; give a file itself to have it cut into documents at blank "
               f"lines, or more files" if root.is_dir() else
               f"{root} is cut into documents at blank lines: {found} here; separate more by blank lines")
        raise ConfigError(f"prepare-text: {root} gives no document to the {empty[0]} split (every {TEST_EVERY}th "
                          f"document is held out for testing): {how}, or give SRC/train and SRC/test")
    if tok.sha256:  # a learned or a pretrained one goes with the corpus
        atomic_text(out / "tokenizer.json", tok.to_json())
    manifest = {"format": FORMAT, "source": str(root.resolve()), "tokenizer": tok.spec, "vocab_size": vocab,
                "dtype": dtype.name, "test_every": TEST_EVERY, "splits": splits,
                "unigram_entropy": unigram_entropy(writers["train"].counts),
                **({"tokenizer_sha256": tok.sha256, "tokens_learned": tok.learned,
                    "non_utf8_bytes": invalid} if tok.sha256 else {}),
                **({"eos_token_id": tok.eos} if getattr(tok, "eos", None) is not None else {})}
    atomic_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def notes(manifest: dict) -> list[str]:
    """What a preparation could not do as asked: a BPE that learned fewer tokens than its vocabulary
    holds, training text that is not UTF-8."""
    out = []
    learned, vocab = manifest.get("tokens_learned"), manifest.get("vocab_size")
    if isinstance(learned, int) and isinstance(vocab, int) and learned < vocab:
        out.append(f"the BPE learned {learned:,} of the {vocab:,} tokens asked (its training text has no more pairs "
                   f"seen twice to merge): the files and a model's vocabulary still count {vocab:,}; "
                   f"--tokenizer bpe:{learned} makes them no larger than what it learned")
    if manifest.get("non_utf8_bytes"):
        out.append(f"{manifest['non_utf8_bytes']:,} bytes of the training text are not UTF-8: the BPE reads each as "
                   f"U+FFFD (the replacement character), so decoding does not give them back; convert the text to "
                   f"UTF-8 first (or use --tokenizer bytes, which keeps every byte)")
    return out


def describe(manifest: dict) -> str:
    """One line for ``prepare-text``'s output."""
    s = manifest["splits"]
    return (f"{s['train']['tokens']:,} training and {s['test']['tokens']:,} test tokens ({manifest['tokenizer']}, "
            f"{manifest['dtype']}) from {s['train']['documents']:,} + {s['test']['documents']:,} documents; "
            f"unigram entropy {manifest['unigram_entropy']:.3f} nats/token "
            f"({math.exp(manifest['unigram_entropy']):.1f} perplexity)")
