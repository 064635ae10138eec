"""Snapshots of a training run, written by every rank together and read back exactly.

A snapshot is a directory ``SNAPSHOT_DIR/step-00000120/`` holding one file per rank
(``rank-00000.pt`` ...: that rank's model or model shard, optimizer state, LR scheduler, RNG
states; rank 0's also the metrics history, the best validation loss and its model) and
``meta.json``, written last, which names the run's layout and each rank file's SHA-256 and size.

**Atomic.** Ranks write into ``.tmp-step-00000120/`` (each file fsynced); rank 0 writes
``meta.json`` and renames the directory into place, so a crash at any moment leaves either the
complete new snapshot or none at all -- never half of one where a reader would find it. An
existing directory of the same name (a snapshot that was refused as bad) is moved aside, never
overwritten. Only the newest ``keep`` snapshots are kept.

**Owned.** ``meta.json`` names the run that wrote it (``run_id``, kept across resumes and restarts)
and the fingerprint of its configuration. A run prunes only its own snapshots and refuses to
start fresh in a directory holding another run's (:func:`foreign`): it never deletes, overwrites
or resumes what it did not write.

**Safe to read.** Files are loaded with ``torch.load(weights_only=True)`` (tensors and plain
containers only: nothing in a file is ever executed) after their checksum matched. A snapshot
from another model or training configuration is refused with an error naming the difference; one
from another world size or strategy is read whole by every rank and resharded
(:mod:`distlab.train.reshard`).

The directory must be visible to every rank under the same path (one machine, or a shared
file system across nodes, as torch's distributed checkpoints assume).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from distlab.errors import ConfigError
from distlab.runtime import group_rank, group_size

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class SnapshotError(ConfigError):
    """A snapshot that cannot be used: missing, truncated, corrupt, or from another run layout."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _world() -> tuple[int, int]:
    return group_rank(), group_size()


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank (as is without a process group)."""
    rank, world = _world()
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_objects(obj) -> list | None:
    """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """torch (CPU and CUDA), numpy and python generator states as tensors and plain values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- write


def _serialize(payload: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _problem(exc: OSError, path: Path) -> str:
    """One line for a failed write: what, where, and the system's reason."""
    reason = exc.strerror or str(exc)
    return f"{reason} (errno {exc.errno}) writing {path}" if exc.errno else f"{reason} writing {path}"


def _kill_while_writing(rank: int, step: int) -> None:
    """Fault drill: ``DISTLAB_KILL_IN_SNAPSHOT=RANK:STEP`` SIGKILLs that rank after its file of that
    step's snapshot is written and before the snapshot is committed (first attempt only)."""
    spec = os.environ.get("DISTLAB_KILL_IN_SNAPSHOT")
    if spec and int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) == 0:
        victim, at = (int(v) for v in spec.split(":"))
        if (victim, at) == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)


def save(directory: str | Path, step: int, payload: dict, meta: dict, keep: int) -> Path:
    """Write this rank's ``payload`` into snapshot ``step`` (collective: every rank calls it).

    ``meta`` (rank 0's) describes the run (its ``run_id`` and layout); it goes into ``meta.json``
    with every rank file's checksum. Returns the snapshot directory. A write that fails on any rank
    (a full disk, a read-only directory) fails on every rank with one :class:`SnapshotError`; the
    partial snapshot is removed and the earlier ones are untouched.
    """
    rank, world = _world()
    root = Path(directory)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crash mid-write: never committed, so nobody reads it
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            error = _problem(exc, tmp)
    error = broadcast_object(error)  # also: the directory exists before anyone writes into it
    if error is None:
        try:
            data = _serialize(payload)
            _write_file(tmp / rank_file_name(rank), data)
            digest = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        except OSError as exc:
            digest = {"error": _problem(exc, tmp / rank_file_name(rank))}
        _kill_while_writing(rank, step)
        digests = _gather_objects(digest)
        if rank == 0:
            error = next((d["error"] for d in digests if "error" in d), None)
            if error is None:
                try:
                    _commit(root, tmp, final, step, world, digests, meta, keep)
                except OSError as exc:
                    error = _problem(exc, tmp)
            if error is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        error = broadcast_object(error)  # committed (or not) for everyone before anyone goes on
    if error is not None:
        previous = next((p for p in snapshots(root) if p != final), None)
        kept = f"the previous snapshot {previous} is intact" if previous else "there is no earlier snapshot"
        raise SnapshotError(f"the snapshot of step {step} could not be written: {error}; {kept}. Free space in "
                            f"{root} or give another --snapshot-dir, then continue with --resume auto")
    return final


def _commit(root: Path, tmp: Path, final: Path, step: int, world: int, digests: list, meta: dict,
            keep: int) -> None:
    """Rank 0: write ``meta.json`` into the complete ``tmp`` and rename it into place; prune."""
    record = {"format": FORMAT, "step": step, "world_size": world,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "files": {rank_file_name(r): d for r, d in enumerate(digests)}, **meta}
    _write_file(tmp / "meta.json", (json.dumps(record, indent=1) + "\n").encode())
    _fsync_dir(tmp)
    if final.exists():  # a snapshot of this step that was refused: keep it for inspection
        aside = root / f"{final.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.replace(final, aside)
        warnings.warn(f"moved the earlier snapshot {final} aside to {aside.name}", stacklevel=3)
    os.replace(tmp, final)
    _fsync_dir(root)
    prune(root, keep, meta.get("run_id"))


def snapshots(directory: str | Path) -> list[Path]:
    """Committed snapshot directories under ``directory``, newest (highest step) first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), reverse=True)


def owner(path: Path) -> str | None:
    """The ``run_id`` in a snapshot's ``meta.json`` (None: unreadable, or written before runs had one)."""
    try:
        return json.loads((path / "meta.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def prune(directory: str | Path, keep: int, run_id: str | None = None) -> None:
    """Delete all but the newest ``keep`` snapshots of run ``run_id`` (``keep`` <= 0 keeps all);
    other runs' snapshots are never touched."""
    if keep <= 0:
        return
    for old in [p for p in snapshots(directory) if owner(p) == run_id][keep:]:
        shutil.rmtree(old, ignore_errors=True)


def foreign(directory: str | Path | None, run_id: str | None) -> list[Path]:
    """Snapshots in ``directory`` that run ``run_id`` did not write, newest first."""
    return [p for p in snapshots(directory) if owner(p) != run_id] if directory else []


# --------------------------------------------------------------------------- read


def read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise SnapshotError(f"snapshot {path} has no meta.json (not a distlab snapshot, or not completely written)")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"snapshot {path}: meta.json is corrupt ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "files" not in meta:
        raise SnapshotError(f"snapshot {path}: meta.json is not a distlab snapshot description of format {FORMAT}")
    return meta


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


def check_compatible(path: Path, meta: dict, expected: dict) -> None:
    """Refuse a snapshot whose run layout differs from this run's, naming the first difference."""
    for key, want in expected.items():
        have = meta.get(key)
        if have != want:
            label = key.replace("_", " ")
            raise SnapshotError(f"snapshot {path} was written with {label} {have!r}, this run has {want!r}: "
                                f"resume with the same settings, or start afresh with another --snapshot-dir")


def load_rank_file(path: Path, meta: dict, rank: int) -> dict:
    """This rank's payload, after checking that its file is complete and unchanged."""
    name = rank_file_name(rank)
    expected = meta["files"].get(name)
    file = path / name
    if expected is None:
        raise SnapshotError(f"snapshot {path} has no entry for {name} (written by {len(meta['files'])} ranks)")
    if not file.is_file():
        raise SnapshotError(f"snapshot {path} is missing {name}")
    data = file.read_bytes()
    if len(data) != expected["bytes"]:
        raise SnapshotError(f"snapshot {file} is truncated or altered: {len(data)} bytes, meta.json says "
                            f"{expected['bytes']}")
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise SnapshotError(f"snapshot {file} is corrupt: its SHA-256 does not match meta.json")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not loadable"
        raise SnapshotError(f"snapshot {file} cannot be loaded safely ({type(exc).__name__}: {exc})") from None


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
    """Load ``path`` for ``rank``; keys in ``reshardable`` may differ from ``expected`` (then every rank file is read)."""
    try:
        meta = read_meta(path)
        check_compatible(path, meta, {k: v for k, v in expected.items() if k not in reshardable})
        if all(meta.get(k) == expected.get(k) for k in reshardable):
            return Loaded(path, meta, load_rank_file(path, meta, rank)), None
        payloads = [load_rank_file(path, meta, r) for r in range(len(meta["files"]))]
        return Loaded(path, meta, payloads[0], payloads), None
    except SnapshotError as exc:
        return None, str(exc)


def _all_ok(ok: bool) -> bool:
    rank, world = _world()
    if world == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _first_reason(reason: str | None) -> str:
    """One rank's reason for refusing, the same on every rank."""
    reasons = _gather_objects(reason)
    rank, _ = _world()
    first = next((r for r in reasons if r), "refused by another rank") if rank == 0 else None
    return broadcast_object(first)


def resume(target: str, directory: str | None, expected: dict, on_warning=print,
           reshardable: tuple[str, ...] = ()) -> Loaded | None:
    """Find and load the snapshot to resume from (collective: every rank calls it).

    ``target`` is ``"auto"`` (the newest snapshot in ``directory`` that every rank can load;
    bad ones are skipped with a warning; ``None`` if there is none at all) or a snapshot path
    (used as is, or a clear error). Every rank gets its own payload of the same snapshot -- or,
    where it differs from ``expected`` only in ``reshardable`` keys (world size, strategy), every
    rank's payloads, to reshard (:mod:`distlab.train.reshard`).
    """
    rank, _ = _world()
    if target != "auto":
        check_path(target)  # the same answer on every rank: they share the file system
        path = Path(target)
        loaded, reason = _try(path, expected, rank, reshardable)
        if not _all_ok(loaded is not None):
            raise SnapshotError(_first_reason(reason))
        return loaded
    if directory is None:
        raise ConfigError("--resume auto looks in --snapshot-dir: give one")
    candidates = broadcast_object([str(p) for p in snapshots(directory)])
    refused = []
    for candidate in candidates:
        loaded, reason = _try(Path(candidate), expected, rank, reshardable)
        if _all_ok(loaded is not None):
            if refused and rank == 0:
                on_warning(f"distlab: warning: resuming from {candidate}, the newest good snapshot "
                           f"({len(refused)} newer one(s) refused)")
            return loaded
        reason = _first_reason(reason)
        refused.append(reason)
        if rank == 0:
            on_warning(f"distlab: warning: {reason}; trying an older snapshot")
    if refused:
        raise SnapshotError(f"none of the {len(refused)} snapshots in {directory} can be used (the newest: "
                            f"{refused[0]}); move them away or use another --snapshot-dir to start afresh")
    return None
