"""``text:PATH``: your own text for next-token prediction -- a file, or a directory of files.

Documents, as :mod:`distlab.data.text_documents` reads them (``prepare-text``'s reader too): in a directory,
each file is one (every regular file below it, hidden ones skipped, linked directories followed, in path order);
a single file is cut into documents at blank lines (paragraphs, verses, speeches).
``PATH/train`` and ``PATH/test``, if both are directories, are the splits as given; otherwise a
seeded tenth of the documents (at least one, the same on every rank and every run) is held out as
the test split, whole documents, so no text is in both. A split is its documents joined by a
blank line, in order, one stream (the windows of :class:`~distlab.data.text.TextDataset` run
across document boundaries, as in the built-in corpus).

A file that is not text (it holds NUL bytes) or cannot be read is an error naming it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from distlab.data import text_documents
from distlab.errors import ConfigError

PREFIX = "text:"
TEST_FRACTION = 0.1
SPLIT_SEED = 0
JOIN = b"\n\n"


def path_of(spec: str) -> Path:
    path = Path(spec[len(PREFIX):])
    if not spec[len(PREFIX):] or not path.exists():
        raise ConfigError(f"--dataset {spec}: there is no file or directory {path}")
    return path


@functools.lru_cache(maxsize=4)
def split_bytes(spec: str) -> tuple[bytes, bytes]:
    """(training text, test text) of ``text:PATH``, its documents read by the corpus reader
    (:mod:`distlab.data.text_documents`)."""
    root = path_of(spec)
    by: dict[str | None, list[bytes]] = {}
    for split, doc in text_documents.documents(root, f"--dataset {spec}"):
        by.setdefault(split, []).append(b"".join(doc).rstrip(b"\n"))
    if (root / "train").is_dir() and (root / "test").is_dir():
        for split in text_documents.SPLITS:
            if not by.get(split):
                raise ConfigError(f"--dataset {spec}: {root / split} holds no text")
        train, test = by["train"], by["test"]
    else:
        docs = by.get(None, [])
        if not docs:
            raise ConfigError(f"--dataset {spec}: {root} holds no text")
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
