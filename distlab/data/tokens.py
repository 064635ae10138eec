"""``tokens:DIR``: a corpus tokenized once into flat token files (``distlab prepare-text``:
:mod:`distlab.data.prepare`), memory-mapped, never loaded whole.

A prepared directory holds

* ``DIR/train.bin``, ``DIR/test.bin``: every token of the split, one after another, little-endian
  ``uint16`` when the vocabulary fits in 16 bits, else ``uint32`` (nanoGPT's ``train.bin``; the
  documents of a split joined by a blank line, the same stream ``text:PATH`` would tokenize);
* ``DIR/manifest.json``: the tokenizer, the vocabulary, the element type, and per split its tokens,
  documents, text bytes and the file's SHA-256; the training split's unigram entropy (the baseline
  loss a run reports, computed once rather than from the whole file at every start);
* ``DIR/tokenizer.json`` for ``bpe:N``.

The manifest is written last: a directory without one is not a prepared corpus -- unless it is nanoGPT's:
``train.bin`` and ``val.bin`` of ``uint16`` token ids and nothing that says what they mean, read given the
vocabulary (``--vocab-size``: :func:`bare_manifest`; its ``meta.pkl``, a pickle, is never read). Such a
corpus has no tokenizer (its ids are trained on as they are, no text is generated from them) and no
checksums (its ids are still checked against the vocabulary). Before a run's first
step the files are checked against it (:func:`verify`: checksums and token ids, one streaming pass,
remembered), and ``--dataset tokens:DIR`` memory-maps them (:func:`load_tokens`): a window is read from
disk when a batch needs it, so a run's memory does not grow with the corpus, and windows are drawn by
the same seeded sampler as every other data set (the same batches on every layout; a resume skips to
its batch).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError, WriteError

PREFIX = "tokens:"
FORMAT = "distlab-tokens/1"
TEST_EVERY = 10  # document i is held out for testing when i % 10 == 9
SPLITS = ("train", "test")


def atomic_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise WriteError(path, exc) from None


# --------------------------------------------------------------------------- reading a prepared corpus


def path_of(spec: str) -> Path:
    path = Path(spec[len(PREFIX):])
    if not spec[len(PREFIX):] or not path.is_dir():
        raise ConfigError(f"--dataset {spec}: there is no directory {path} (make one with distlab prepare-text SRC "
                          f"{path or 'DIR'})")
    return path


BARE = "bare ids"  # the tokenizer of a corpus of token ids alone (nanoGPT's): none
BARE_FILES = {"train": "train.bin", "test": "val.bin"}


def is_bare(spec: str) -> bool:
    """Whether ``tokens:DIR`` is nanoGPT's layout (``train.bin`` and ``val.bin``, no manifest)."""
    root = Path(spec[len(PREFIX):])
    return not (root / "manifest.json").exists() and all((root / f).is_file() for f in BARE_FILES.values())


def bare_manifest(spec: str, vocab_size: int | None) -> dict:
    """The manifest of nanoGPT's ``train.bin``/``val.bin`` (uint16 ids; ``val`` is the test split), given the
    vocabulary it cannot say itself."""
    root = path_of(spec)
    if vocab_size is None:
        raise ConfigError(f"--dataset {spec}: {root} holds train.bin and val.bin without a manifest (nanoGPT's "
                          f"layout: uint16 token ids): give their vocabulary with --vocab-size N (e.g. 50304 for "
                          f"GPT-2's ids){'; its meta.pkl is a pickle, never read' if (root / 'meta.pkl').exists() else ''}")
    if not 1 <= vocab_size <= 1 << 16:
        raise ConfigError(f"--dataset {spec}: uint16 ids address at most 65,536 tokens, not `vocab_size` "
                          f"{vocab_size:,}")
    splits = {}
    for split, name in BARE_FILES.items():
        size = (root / name).stat().st_size
        if size % 2:
            raise ConfigError(f"--dataset {spec}: {root / name} holds {size:,} bytes, not whole uint16 token ids")
        splits[split] = {"file": name, "tokens": size // 2, "bytes": 0, "sha256": None}
    return {"format": "nanogpt", "dtype": "uint16", "vocab_size": vocab_size, "tokenizer": BARE, "splits": splits}


def manifest_of(spec: str, vocab_size: int | None = None) -> dict:
    """The checked manifest of ``tokens:DIR``: its format, element type and every split's file, whose size
    must be its tokens (a truncated or foreign file is refused before any work); of a bare corpus,
    :func:`bare_manifest`."""
    root = path_of(spec)
    where = root / "manifest.json"
    if is_bare(spec):
        return bare_manifest(spec, vocab_size)
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--dataset {spec}: {root} has no manifest.json, so it is not a prepared corpus (or its "
                          f"preparation did not finish): run distlab prepare-text SRC {root}") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"--dataset {spec}: cannot read {where} ({exc})") from None
    ok = isinstance(manifest, dict) and manifest.get("format") == FORMAT \
        and isinstance(manifest.get("splits"), dict) and all(isinstance(manifest["splits"].get(s), dict) for s in SPLITS)
    if not ok:
        raise ConfigError(f"--dataset {spec}: {where} is not a manifest of distlab prepare-text ({FORMAT})")
    bad = _malformed(manifest)
    if bad:
        raise ConfigError(f"--dataset {spec}: {where} is damaged: {bad}; prepare the corpus again")
    item = np.dtype(manifest["dtype"]).itemsize
    for s in SPLITS:
        entry = manifest["splits"][s]
        path = root / Path(entry["file"]).name
        size = path.stat().st_size if path.is_file() else None
        if size != entry["tokens"] * item:
            raise ConfigError(f"--dataset {spec}: {path} " + ("is missing" if size is None else
                              f"holds {size:,} bytes, not the {entry['tokens']:,} tokens x {item} bytes its "
                              f"manifest says") + ": prepare the corpus again")
    return manifest


def _malformed(manifest: dict) -> str | None:
    """What in a manifest is not as prepare-text writes it (None: nothing)."""
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if manifest.get("dtype") not in ("uint16", "uint32"):
        return f"dtype {manifest.get('dtype')!r} is neither uint16 nor uint32"
    if not count(manifest.get("vocab_size")) or not manifest["vocab_size"]:
        return f"vocab_size {manifest.get('vocab_size')!r} is not a positive count"
    if manifest["vocab_size"] > np.iinfo(manifest["dtype"]).max + 1:
        return f"vocab_size {manifest['vocab_size']:,} does not fit {manifest['dtype']}"
    if not isinstance(manifest.get("tokenizer"), str):
        return f"tokenizer {manifest.get('tokenizer')!r} is not a tokenizer's name"
    entropy = manifest.get("unigram_entropy")
    if entropy is not None and (not isinstance(entropy, (int, float)) or isinstance(entropy, bool)
                                or not math.isfinite(entropy)):
        return f"unigram_entropy {entropy!r} is not a number"
    for s in SPLITS:
        entry = manifest["splits"][s]
        if not isinstance(entry.get("file"), str) or not entry["file"]:
            return f"the {s} split's file {entry.get('file')!r} is not a file name"
        for name in ("tokens", "documents", "bytes"):
            if not count(entry.get(name)):
                return f"the {s} split's {name} {entry.get(name)!r} is not a count"
        digest = entry.get("sha256")
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            return f"the {s} split's sha256 {digest!r} is not a SHA-256"
    return None


VERIFIED = "verified-tokens.json"  # in the user's cache: the files whose checks passed, and how they looked


def cache_dir() -> Path:
    """Where distlab remembers what it checked: ``$DISTLAB_CACHE``, else ``$XDG_CACHE_HOME/distlab``, else
    ``~/.cache/distlab`` -- the user's own, never an input directory (whose files anyone who wrote it could
    forge)."""
    if os.environ.get("DISTLAB_CACHE"):
        return Path(os.environ["DISTLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "distlab"
CHUNK = 1 << 24  # bytes read at a time: checking a corpus of any size holds this much


def verify(spec: str, manifest: dict, progress: bool = False) -> None:
    """Before the first step: every split's file is the one its manifest describes -- its SHA-256 -- and
    holds no token id the vocabulary lacks (a corrupt token would crash a run mid-way, or train on wrong
    text silently). One streaming pass per file, :data:`CHUNK` bytes at a time; a file that passed is
    remembered in the user's cache (:func:`cache_dir`; nothing is written into the corpus) by its path, size,
    inode and modification and change times -- a file rewritten, even with its modification time set back,
    has a new change time -- so later runs and the other ranks do not read it again. The first bad id is
    named with its offset."""
    root = path_of(spec)
    cache = cache_dir() / VERIFIED
    record = _verified(cache)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    vocab = manifest["vocab_size"]
    changed = False
    for s in SPLITS:
        entry = manifest["splits"][s]
        path = root / Path(entry["file"]).name
        st = path.stat()
        key = str(path.resolve())
        stamp = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns,
                 entry["sha256"] or vocab]  # a bare corpus: checked for its vocabulary
        if record.get(key) == stamp:
            continue
        sha, offset = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while True:
                chunk = f.read(CHUNK)
                if not chunk:
                    break
                sha.update(chunk)
                ids = np.frombuffer(chunk[:len(chunk) - len(chunk) % dtype.itemsize], dtype=dtype)
                if len(ids) and int(ids.max()) >= vocab:
                    first = int(np.argmax(ids >= vocab))
                    raise ConfigError(f"--dataset {spec}: {path} holds token id {int(ids[first]):,} at token "
                                      f"{offset + first:,}, outside the vocabulary of {vocab:,}: the file is damaged "
                                      f"or from another tokenizer; prepare the corpus again")
                offset += len(ids)
        if entry["sha256"] and sha.hexdigest() != entry["sha256"]:
            raise ConfigError(f"--dataset {spec}: {path} is not the file its manifest describes (its SHA-256 "
                              f"{sha.hexdigest()[:16]}... is not {entry['sha256'][:16]}...): it was changed or "
                              f"damaged after prepare-text wrote it; prepare the corpus again")
        record[key] = stamp
        changed = True
    if changed:
        with contextlib.suppress(OSError, WriteError):  # no cache to write: checked again next time, nothing worse
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_text(cache, json.dumps(record) + "\n")


def _verified(cache: Path) -> dict:
    try:
        record = json.loads(cache.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def tokenizer_of(spec: str, manifest: dict):
    if manifest["tokenizer"] == BARE:
        return None
    if manifest["tokenizer"] == tokenizers.BYTES:
        return tokenizers.ByteTokenizer()
    where = path_of(spec) / "tokenizer.json"
    try:
        text = where.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--dataset {spec}: cannot read {where} ({exc})") from None
    if manifest["tokenizer"] == "hf":  # a pretrained model's (prepare-text --tokenizer hf:DIR)
        return tokenizers.HFTokenizer.from_json(text, manifest["vocab_size"], str(where), manifest.get("eos_token_id"))
    return tokenizers.BPETokenizer.from_json(text, manifest["vocab_size"], where=str(where))


def _mapped(path: Path, dtype: np.dtype) -> torch.Tensor:
    """The file as a read-only tensor over a shared mapping, advised random access: windows are drawn
    anywhere in it, and the kernel's read-ahead (8 MB a fault on some disks) would otherwise map
    megabytes around each one -- resident memory growing by ~15 MB a step for a batch of 16 windows."""
    import mmap
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return torch.from_numpy(np.zeros(0, dtype=dtype))
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid after the file is closed
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_RANDOM)
    array = np.frombuffer(mapping, dtype=dtype)  # holds the mapping
    with warnings.catch_warnings():  # read only: torch warns that it cannot protect the mapping from writes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def load_tokens(spec: str, split: str, block_size: int, vocab_size: int | None = None):
    """``split`` of ``tokens:DIR`` as windows of ``block_size + 1`` tokens over the memory-mapped file
    (checked first: :func:`verify`); ``vocab_size``: a bare corpus's vocabulary."""
    from distlab.data.text import TextDataset
    manifest = manifest_of(spec, vocab_size)
    verify(spec, manifest)
    entry = manifest["splits"][split]
    path = path_of(spec) / Path(entry["file"]).name
    tokens = _mapped(path, np.dtype(manifest["dtype"]).newbyteorder("<"))
    tok = tokenizer_of(spec, manifest)
    data = TextDataset.from_tokens(spec, split, tokens, block_size, str(path), tokenizer=tok,
                                   text_bytes=entry["bytes"] or None, vocab=manifest["vocab_size"])
    data.entropy = manifest.get("unigram_entropy") if split == "train" else None
    data.mapped = True
    if tok is None:  # a bare corpus: what a token is, and so its rate on text, is not known
        data.tokens_per_byte = None
    return data


def shape(spec: str, block_size: int, vocab_size: int | None = None) -> tuple[tuple[int, ...], int]:
    return (block_size,), manifest_of(spec, vocab_size)["vocab_size"]


