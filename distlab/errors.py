"""Errors that the CLI prints as one line (``distlab: error: ...``) instead of a traceback.

Anything that is the user's to fix (a flag, a path, a port, a peer that never came) raises one
of these with a message that says what was wrong and what to do. A plain exception is a bug.
"""

from __future__ import annotations


class DistlabError(Exception):
    """Base class: a problem the user can fix. ``exit_code`` is what the CLI exits with;
    ``every_rank`` says every rank meets the same one (then rank 0 alone prints it)."""

    exit_code = 1
    every_rank = False


class ConfigError(DistlabError):
    """Invalid flags or an invalid combination of flags; found before any work is done."""

    exit_code = 2
    every_rank = True


class RankConfigError(ConfigError):
    """A configuration problem of one rank alone (say, its device): every rank that has it says so.

    Plain :class:`ConfigError`s are the same on every rank, so only rank 0 prints them.
    """

    every_rank = False


class DataNotFoundError(ConfigError):
    """A dataset that is not on disk where we looked."""


class NonFiniteError(DistlabError):
    """Training produced a non-finite loss or gradient (nan, inf) outside fp16's loss scaling: the
    step was not applied, so the model and optimizer still hold the last good state. Every rank
    finds it at the same step."""

    every_rank = True


class FinalWriteError(DistlabError):
    """A run trained to its end but its final snapshot or model file could not be written; its summary and
    metrics were written, and the message names the newest snapshot that holds its work."""

    every_rank = True


class DistributedError(DistlabError):
    """Start-up or communication failed: a peer is missing or dead, a port is taken."""


class WriteError(DistlabError, OSError):
    """A file of the run's output could not be written (a full or read-only disk): one line naming it.
    Also an :class:`OSError` (with the original ``errno``), so code that handles those still does."""

    def __init__(self, path, exc: OSError, advice: str = "free some space, or give the run another place to write"):
        super().__init__(exc.errno, exc.strerror)
        self.message = f"could not write {path}: {exc.strerror or exc} (errno {exc.errno}); {advice}"

    def __str__(self) -> str:
        return self.message


SPELLED = ("mlp", "nd", "nn.", "hf", "fp", "lm", "lstm", "rnn", "sgd", "rms", "mse", "fsdp")  # said letter by letter


def with_article(word: object) -> str:
    """``word`` with its indefinite article as it is said: "an mlp", "an nn.Sequential", "a Sequential",
    "an Embedding", "a gpt" (a name said letter by letter takes the article of its first letter's sound)."""
    text = str(word)
    vowel = text[:1].lower() in "aeiou" or text.lower().startswith(SPELLED)
    return f"{'an' if vowel else 'a'} {text}"


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of ``exc``'s message (its type's name when it has none), at most ``limit`` chars."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:limit]


def did_you_mean(word: str, choices, synonyms: dict | None = None) -> str:
    """`` (did you mean X?)`` when ``word`` is a near miss of one of ``choices`` (or a known other name
    for it, ``synonyms``: ``learning_rate`` -> ``lr``), else ``""``; for the end of an error message."""
    import difflib
    hit = (synonyms or {}).get(str(word).lower().replace("-", "_"))
    if hit is None:
        close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
        hit = close[0] if close else None
    return f" (did you mean {hit}?)" if hit else ""


def human_bytes(nbytes) -> str:
    """Bytes in the unit that reads best: 512 B, 3.1 KiB, 2.04 MiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def check_place(out, flag: str = "-o") -> None:
    """Refuse, in one line, an output path ``out`` that cannot or must not be written: a file standing where
    one of its parent directories must be, or a place inside a snapshot (a run deletes older snapshots, and a
    file written there would replace one of the snapshot's own)."""
    from pathlib import Path
    root = Path(out).resolve()
    for parent in root.parents:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{flag} {out}: {parent} is a file, not a directory; give a path under a directory")
    for parent in (root, *root.parents):
        if parent.is_dir() and (parent / "meta.json").is_file() and any(parent.glob("rank*")):
            raise ConfigError(f"{flag} {out} lies inside snapshot {parent}, which a run deletes when it keeps newer "
                              f"ones: give a path outside the snapshots")


def confined(path, where: str, root=None):
    """``path``, a file of directory ``root`` (by default its parent), where it is inside that directory once
    its links are followed -- a symbolic link to a file elsewhere (``chat_template.jinja -> ~/.ssh/id_rsa``) is
    refused in one line, before it is opened. The one link out allowed is the Hugging Face cache's, from a
    snapshot ``snapshots/<revision>/`` to the blob beside it (``../../blobs/<hash>``)."""
    from pathlib import Path
    path = Path(path)
    base = (path.parent if root is None else Path(root)).resolve()
    real = path.resolve()
    if real.is_relative_to(base) or (base.parent.name == "snapshots" and real.parent == base.parent.parent / "blobs"):
        return path
    name = path.relative_to(root) if root is not None and path.is_relative_to(root) else path.name
    raise ConfigError(f"{where}: {name} is a link to a file outside the directory; only files inside it are read "
                      f"(copy that file into the directory if it belongs to it)")
