"""``text:PATH``: your own text for next-token prediction -- a file, or a directory of files.

Documents: in a directory, each file is one (every regular file below it, hidden ones skipped,
linked directories followed, in path order); a single file is cut into documents at blank lines (paragraphs, verses, speeches).
``PATH/train`` and ``PATH/test``, if both are directories, are the splits as given; otherwise a
seeded tenth of the documents (at least one, the same on every rank and every run) is held out as
the test split, whole documents, so no text is in both. A split is its documents joined by a
blank line, in order, one stream (the windows of :class:`~distlab.data.text.TextDataset` run
across document boundaries, as in the built-in corpus).

A file that is not text (it holds NUL bytes) or cannot be read is an error naming it.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch

from distlab.errors import ConfigError

PREFIX = "text:"
TEST_FRACTION = 0.1
SPLIT_SEED = 0
JOIN = b"\n\n"
_BLANK_LINES = re.compile(rb"\n[ \t\r]*\n\s*")


def path_of(spec: str) -> Path:
    path = Path(spec[len(PREFIX):])
    if not spec[len(PREFIX):] or not path.exists():
        raise ConfigError(f"--dataset {spec}: there is no file or directory {path}")
    return path


def _read(path: Path, spec: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--dataset {spec}: cannot read {path} ({exc.strerror or exc})") from None
    if b"\0" in data:
        raise ConfigError(f"--dataset {spec}: {path} is not text (it holds NUL bytes): give text files only")
    return data.replace(b"\r\n", b"\n")


def files_below(root: Path) -> list[Path]:
    """Every regular file below ``root`` in path order, hidden ones (a name starting with ".") and those
    below hidden directories skipped; symbolic links to directories followed, each directory once (a
    link back up the tree is not a loop)."""
    out, seen = [], set()
    for here, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(here) / n for n in names if not n.startswith(".") and (Path(here) / n).is_file()]
    return sorted(out, key=lambda p: p.relative_to(root).parts)


def _documents(path: Path, spec: str) -> list[bytes]:
    if path.is_file():
        docs = [d for d in _BLANK_LINES.split(_read(path, spec).strip(b"\n")) if d.strip()]
    else:
        files = files_below(path)
        docs = [d for d in (_read(p, spec).strip(b"\n") for p in files) if d.strip()]
    if not docs:
        raise ConfigError(f"--dataset {spec}: {path} holds no text")
    return docs


@functools.lru_cache(maxsize=4)
def split_bytes(spec: str) -> tuple[bytes, bytes]:
    """(training text, test text) of ``text:PATH``."""
    root = path_of(spec)
    if root.is_dir() and (root / "train").is_dir() and (root / "test").is_dir():
        train, test = _documents(root / "train", spec), _documents(root / "test", spec)
    else:
        docs = _documents(root, spec)
        if len(docs) < 2:
            what = "separate documents by a blank line" if root.is_file() else \
                "in a directory each file is one document, its paragraphs not split: give the file itself to have " \
                "it cut into documents at blank lines, or more files"
            raise ConfigError(f"--dataset {spec}: {root} is one document, so none can be held out for testing: "
                              f"{what}, or give PATH/train and PATH/test")
        order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
        held = set(order[:max(1, round(len(docs) * TEST_FRACTION))])
        train = [d for i, d in enumerate(docs) if i not in held]
        test = [d for i, d in enumerate(docs) if i in held]
    return JOIN.join(train) + b"\n", JOIN.join(test) + b"\n"

