"""Reading a snapshot back (:mod:`distlab.train.snapshot` writes it): ``meta.json`` checked to be one,
each rank file's SHA-256 and size against it before ``torch.load(weights_only=True)``, the payload's
fields validated (:mod:`distlab.train.snapshot_checks`), the configuration compared with the run's, and
``resume``: the newest snapshot every rank can read, a damaged one moved aside with a warning.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.errors import ConfigError, confined, first_line
from distlab.train.snapshot_checks import payload_problem

from distlab.train.snapshot import (DamagedSnapshot, IncompatibleSnapshot, SnapshotError, broadcast_object,
                                    gather_objects, move_aside, rank_file_name, read_meta, snapshots, world_of)


def check_path(path: str | Path, what: str = "--resume") -> None:
    """Before launching: ``--resume PATH`` (or ``what`` PATH) must be a snapshot directory (one with ``meta.json``)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return
    if snapshots(path):
        hint = f"use --resume auto --snapshot-dir {path} for the newest good one, or name one" if what == "--resume" \
            else "name one"
        raise SnapshotError(f"{what} {path} holds snapshots but is not one: {hint}, e.g. {what} {snapshots(path)[0]}")
    raise SnapshotError(f"{what} {path}: no snapshot there (a snapshot is a step-NNNNNNNN directory with a "
                        f"meta.json, written by --snapshot-dir)")


_WHY = {"total_steps": " (the LR schedule decays over the run's steps: a changed --max-steps or --epochs would "
                      "bend its curve mid-run; only --lr-schedule constant runs may change their length)"}


def check_compatible(path: Path, meta: dict, expected: dict) -> None:
    """Refuse a snapshot whose run layout differs from this run's, naming the first difference."""
    for key, want in expected.items():
        have = meta.get(key)
        if have != want:
            label = key.replace("_", " ")
            why = _WHY.get(key, "")
            raise IncompatibleSnapshot(f"snapshot {path} was written with {label} {have!r}, this run has {want!r}"
                                       f"{why}: resume with the same settings, or start afresh with another "
                                       f"--snapshot-dir")


READ_PIECE = 4 << 20  # bytes hashed at a time


def load_rank_file(path: Path, meta: dict, rank: int) -> dict:
    """This rank's payload, after checking that its file is complete and unchanged."""
    name = rank_file_name(rank)
    expected = meta["files"].get(name)
    file = path / name
    if expected is None:
        raise DamagedSnapshot(f"snapshot {path} has no entry for {name} (written by {len(meta['files'])} ranks)")
    if not file.is_file():
        raise DamagedSnapshot(f"snapshot {path} is missing {name}")
    with open(confined(file, f"snapshot {path}"), "rb") as f:  # hashed in pieces, then loaded from the same open
        sha, size = hashlib.sha256(), 0                          # file: never the whole file in memory beside it
        piece = memoryview(bytearray(READ_PIECE))
        while n := f.readinto(piece):
            sha.update(piece[:n])
            size += n
        if size != expected["bytes"]:
            raise DamagedSnapshot(f"snapshot {file} is truncated or altered: {size} bytes, meta.json says "
                                  f"{expected['bytes']}")
        if sha.hexdigest() != expected["sha256"]:
            raise DamagedSnapshot(f"snapshot {file} is corrupt: its SHA-256 does not match meta.json")
        f.seek(0)
        try:
            payload = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not loadable"
            raise DamagedSnapshot(f"snapshot {file} cannot be loaded safely: {refusal(exc)}") from None
    problem = payload_problem(payload, meta["step"])
    if problem:
        raise DamagedSnapshot(f"snapshot {file} is malformed: {problem}")
    return payload


def refusal(exc: BaseException) -> str:
    """One line for a file ``torch.load(weights_only=True)`` would not read (torch's own message is a page)."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text) or re.search(r"unsupported (?:global|class) (\S+)",
                                                                                  text, re.IGNORECASE)
    if found:
        return f"it holds a Python object ({found.group(1).rstrip('.,')}), not only tensors (refused unread: " \
               f"weights_only)"
    return f"{type(exc).__name__}: {first_line(exc, 200)}"


@dataclass
class Loaded:
    """A snapshot to resume: this rank's ``payload`` -- or, when it was written under another
    layout, every old rank's (``payloads``, in rank order; ``payload`` is then old rank 0's)."""

    path: Path
    meta: dict
    payload: dict
    payloads: list[dict] | None = None

    @property
    def resharded(self) -> bool:
        return self.payloads is not None


def _try(path: Path, expected: dict, rank: int, reshardable: tuple[str, ...] = ()) -> tuple[Loaded | None, str | None]:
    """Load ``path`` for ``rank``; keys in ``reshardable`` may differ from ``expected`` (then every rank file is read).
    The reason for a refusal starts with ``damaged:`` or ``incompatible:``."""
    try:
        meta = read_meta(path)
        check_compatible(path, meta, {k: v for k, v in expected.items() if k not in reshardable})
        if all(meta.get(k) == expected.get(k) for k in reshardable):
            return Loaded(path, meta, load_rank_file(path, meta, rank)), None
        payloads = [load_rank_file(path, meta, r) for r in range(len(meta["files"]))]
        return Loaded(path, meta, payloads[0], payloads), None
    except IncompatibleSnapshot as exc:
        return None, f"incompatible:{exc}"
    except SnapshotError as exc:
        return None, f"damaged:{exc}"
    except OSError as exc:  # unreadable (permissions, I/O error): damaged for this run's purpose
        return None, f"damaged:snapshot {path} cannot be read ({first_line(exc, 200)})"


def _all_ok(ok: bool) -> bool:
    rank, world = world_of()
    if world == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _first_reason(reason: str | None) -> tuple[str, bool]:
    """One rank's reason for refusing, the same on every rank; and whether it is damage (not
    another configuration)."""
    reasons = gather_objects(reason)
    rank, _ = world_of()
    first = None
    if rank == 0:
        refused = [r for r in reasons if r]
        # another configuration is the stronger answer: every rank's damage would not change it
        first = next((r for r in refused if r.startswith("incompatible:")), refused[0] if refused else
                     "damaged:refused by another rank")
    first = broadcast_object(first)
    kind, _, text = first.partition(":")
    return text, kind == "damaged"


def resume(target: str, directory: str | None, expected: dict, on_warning=print,
           reshardable: tuple[str, ...] = (), accept=None) -> Loaded | None:
    """Find and load the snapshot to resume from (collective: every rank calls it).

    ``target`` is ``"auto"`` or a snapshot path (used as is, or a clear error). ``auto`` takes the
    newest snapshot in ``directory`` that every rank can load (``None`` if there is none at all): a
    damaged one (unreadable, malformed, wrong checksum) is moved aside as ``step-N.bad-...`` with a
    warning and the next older one is tried; one of another configuration stops the search with an
    :class:`IncompatibleSnapshot` naming the setting that differs. Every rank gets its own payload
    of the same snapshot -- or, where it differs from ``expected`` only in ``reshardable`` keys
    (world size, strategy), every rank's payloads, to reshard (:mod:`distlab.train.reshard`).
    ``accept(loaded)`` (on every rank) loads it into the run and says what is wrong with it (None:
    nothing): a snapshot that any rank cannot take is damaged too.
    """
    rank, _ = world_of()

    def attempt(path: Path) -> tuple[Loaded | None, str | None]:
        loaded, reason = _try(path, expected, rank, reshardable)
        if _all_ok(loaded is not None) and accept is not None:
            problem = accept(loaded)
            if problem is not None:
                loaded, reason = None, f"damaged:snapshot {path} {problem}"
        return loaded, reason

    if target != "auto":
        check_path(target)  # the same answer on every rank: they share the file system
        path = Path(target)
        loaded, reason = attempt(path)
        if not _all_ok(loaded is not None):
            text, damaged = _first_reason(reason)
            raise (DamagedSnapshot if damaged else IncompatibleSnapshot)(text)
        return loaded
    if directory is None:
        raise ConfigError("--resume auto looks in --snapshot-dir: give one")
    candidates = broadcast_object([str(p) for p in snapshots(directory)])
    refused = []
    for candidate in candidates:
        loaded, reason = attempt(Path(candidate))
        if _all_ok(loaded is not None):
            if refused and rank == 0:
                on_warning(f"distlab: warning: resuming from {candidate}, the newest good snapshot "
                           f"({len(refused)} newer one(s) damaged and moved aside)")
            return loaded
        text, damaged = _first_reason(reason)
        if not damaged:
            raise IncompatibleSnapshot(text)
        refused.append(text)
        if rank == 0:
            where = "kept in place (it could not be moved)"
            try:
                where = f"moved aside to {move_aside(Path(candidate)).name}"
            except OSError:
                pass
            on_warning(f"distlab: warning: {text}; {where}; trying an older snapshot")
        broadcast_object(None)  # nobody reads the directory while rank 0 renames in it
    if refused:
        raise DamagedSnapshot(f"none of the {len(refused)} snapshots in {directory} can be used (the newest: "
                              f"{refused[0]}); they were moved aside as step-N.bad-*: start afresh with "
                              f"--resume off the command line, or restore a good copy")
    return None
