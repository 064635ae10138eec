"""The one reader of a text corpus on disk -- ``text:PATH`` and ``distlab prepare-text`` both read through it: its
documents in reading order, each a stream of lines, never a file held whole.

A file is cut into documents at blank lines (lines of spaces only: paragraphs, verses, speeches); in a
directory each file is one document (every regular file below it, hidden ones skipped, linked directories
followed, in path order), without its leading and trailing empty lines; ``PATH/train`` and ``PATH/test``, if
both are directories, are the splits as given. Lines keep their text as it is but for ``\\r\\n``, made ``\\n``; a
file that is not text (it holds NUL bytes) or cannot be read is an error naming it. Which documents a source
without splits holds out is its reader's choice (``text:PATH``: a seeded tenth; ``prepare-text``: every tenth).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from distlab.data.tokens import SPLITS
from distlab.errors import ConfigError


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


def sources(root: Path) -> list[tuple[str | None, Path, bool]]:
    """(split or None, file, whether the file is one document) in reading order."""
    if root.is_file():
        return [(None, root, False)]
    if (root / "train").is_dir() and (root / "test").is_dir():
        return [(s, p, True) for s in SPLITS for p in files_below(root / s)]
    return [(None, p, True) for p in files_below(root)]


def documents(root: Path, what: str) -> Iterator[tuple[str | None, Iterator[bytes]]]:
    """(split or None, lines) of every document below ``root`` in reading order; ``what`` names the command or flag
    in an error (``prepare-text``, ``--dataset text:PATH``). Each document's lines are read as they are taken."""
    for split, path, whole in sources(root):
        for doc in (_whole if whole else _paragraphs)(Lines(path, what)):
            yield split, doc


class Lines:
    """A file's lines (``\\r\\n`` made ``\\n``, each ``\\n``-terminated), read one at a time, the next one
    visible (``head``) before it is taken."""

    PIECE = 1 << 20  # a line longer than this comes in pieces: a one-line file of any size is never held whole

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        try:
            self.file = open(path, "rb")
        except OSError as exc:
            raise ConfigError(f"{what}: cannot read {path} ({exc.strerror or exc})") from None
        self.continues = False  # whether ``head`` is the rest of a line a piece before it began
        self.head_blank = False
        self.head = self._next()

    def _next(self) -> bytes | None:
        line = self._read()
        self.head_blank = line is not None and not self.continues and not line.strip(b" \t\r\n")
        self.continues = line is not None and not line.endswith(b"\n")
        return line

    def _read(self) -> bytes | None:
        line = self.file.readline(self.PIECE)
        if not line:
            self.file.close()
            return None
        if line.endswith(b"\r"):  # a CRLF cut between two pieces: keep it together
            line += self.file.read(1)
        if b"\0" in line:
            raise ConfigError(f"{self.what}: {self.path} is not text (it holds NUL bytes): give text files only")
        line = line.replace(b"\r\n", b"\n")
        if line.endswith(b"\n") or len(line) >= self.PIECE:  # a whole line, or a piece of a long one
            return line
        return line + b"\n"  # the file's last line, without its newline

    def pop(self) -> bytes:
        line, self.head = self.head, self._next()
        return line


def _blank(lines: Lines) -> bool:
    """Whether the next line holds spaces only (a piece of a long line never is one, the end of one neither)."""
    return lines.head is not None and lines.head_blank


def _paragraphs(lines: Lines) -> Iterator[Iterator[bytes]]:
    """A file's documents at blank lines: each a run of lines with text, read as it is consumed."""
    while True:
        while _blank(lines):
            lines.pop()
        if lines.head is None:
            return

        def paragraph() -> Iterator[bytes]:
            while lines.head is not None and not _blank(lines):
                yield lines.pop()
        doc = paragraph()
        yield doc
        for _ in doc:  # whatever the reader left of it
            pass


def _whole(lines: Lines) -> Iterator[Iterator[bytes]]:
    """A file as one document without its leading and trailing empty lines (none if it holds no text)."""
    before = []
    while _blank(lines):  # held until it is known there is text
        before.append(lines.pop())
    if lines.head is None:
        return

    def doc() -> Iterator[bytes]:
        yield from before[next(i for i, line in enumerate(before + [b"x"]) if line != b"\n"):]
        pending = []
        while lines.head is not None:
            line = lines.pop()
            if line == b"\n":
                pending.append(line)
                continue
            yield from pending
            pending.clear()
            yield line
    yield doc()
