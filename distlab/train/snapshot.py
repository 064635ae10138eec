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

Reading one back -- its meta checked, each rank file's checksum, the resume that picks the newest
good one -- is :mod:`distlab.train.snapshot_load`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from distlab.errors import ConfigError, confined, first_line, with_article
from distlab.runtime import group_rank, group_size
from distlab.train.snapshot_checks import is_int as _is_int
from distlab.train.streamed import HashingFile

FORMAT = 1
STEP_DIR = re.compile(r"^step-(\d{8,})$")  # 8 digits at least: any step fits
MAX_JSON_BYTES = 16 << 20  # a meta.json is a few KiB: anything this large is not one


class SnapshotError(ConfigError):
    """A snapshot that cannot be used: missing, truncated, corrupt, or from another run layout."""


class DamagedSnapshot(SnapshotError):
    """A snapshot that cannot be read: missing files, wrong checksums, a malformed description or
    payload. ``--resume auto`` moves it aside and falls back to an older one."""


class IncompatibleSnapshot(SnapshotError):
    """A readable snapshot of another configuration (its first difference named). Not damage: it is
    left where it is, and ``--resume auto`` does not fall back past it."""


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


def world_of(group=None) -> tuple[int, int]:
    return group_rank(group), group_size(group)


def broadcast_object(obj, group=None):
    """Rank 0's ``obj`` on every rank of ``group`` (the world by default; as is without a process group)."""
    rank, world = world_of(group)
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_objects(obj, group=None) -> list | None:
    """Every rank's ``obj`` on rank 0 (``None`` elsewhere)."""
    rank, world = world_of(group)
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
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


def _write_payload(path: Path, payload: dict) -> dict:
    """``payload`` to ``path`` (torch.save, streamed, synced); returns its checksum and size."""
    with open(path, "wb") as f:
        out = HashingFile(f)
        try:
            torch.save(payload, out)
        except Exception:
            if out.error is not None:  # a full disk, a file system gone read-only: the OSError it was
                raise out.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": out.sha.hexdigest(), "bytes": out.bytes}


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


def save(directory: str | Path, step: int, payload: dict, meta: dict, keep: int, group=None) -> Path:
    """Write this rank's ``payload`` into snapshot ``step`` (collective: every rank calls it).

    ``meta`` (rank 0's) describes the run (its ``run_id`` and layout); it goes into ``meta.json``
    with every rank file's checksum. Returns the snapshot directory. A write that fails on any rank
    (a full disk, a read-only directory) fails on every rank with one :class:`SnapshotError`; the
    partial snapshot is removed and the earlier ones are untouched. ``group``: the process group its
    few collectives use (a group of every rank; the world by default -- an asynchronous snapshot writes
    on a group of its own, beside the training's collectives).
    """
    rank, world = world_of(group)
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
    error = broadcast_object(error, group)  # also: the directory exists before anyone writes into it
    if error is None:
        try:
            digest = _write_payload(tmp / rank_file_name(rank), payload)
        except OSError as exc:
            digest = {"error": _problem(exc, tmp / rank_file_name(rank))}
        _kill_while_writing(rank, step)
        digests = gather_objects(digest, group)
        if rank == 0:
            error = next((d["error"] for d in digests if "error" in d), None)
            if error is None:
                try:
                    _commit(root, tmp, final, step, world, digests, meta, keep)
                except OSError as exc:
                    error = _problem(exc, tmp)
            if error is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        error = broadcast_object(error, group)  # committed (or not) for everyone before anyone goes on
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
        aside = move_aside(final)
        warnings.warn(f"moved the earlier snapshot {final} aside to {aside.name}", stacklevel=3)
    os.replace(tmp, final)
    _fsync_dir(root)
    prune(root, keep, meta.get("run_id"), newest=step)


def step_of(path: Path) -> int:
    """The step in a snapshot directory's name."""
    return int(STEP_DIR.match(path.name).group(1))


def snapshots(directory: str | Path) -> list[Path]:
    """Committed snapshot directories under ``directory``, newest (highest step) first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=step_of, reverse=True)


_UNREADABLE = object()


def owner(path: Path):
    """The ``run_id`` in a snapshot's ``meta.json`` (None: written before runs had one); the
    :data:`_UNREADABLE` marker when its description cannot be read (a damaged snapshot is nobody's)."""
    try:
        return read_meta(path).get("run_id")
    except SnapshotError:
        return _UNREADABLE


def prune(directory: str | Path, keep: int, run_id: str | None = None, newest: int | None = None) -> None:
    """Keep the newest ``keep`` snapshots of run ``run_id`` at or below step ``newest`` (the one just
    written, which counts as one of them); delete its older ones (``keep`` <= 0 keeps all).

    Only snapshots whose description reads and names ``run_id`` are counted or deleted: another
    run's, a damaged one (moved aside by ``--resume auto``) and one of a higher step (a line of the
    run that was abandoned by resuming an older snapshot) are never touched.
    """
    if keep <= 0:
        return
    mine = [p for p in snapshots(directory) if (newest is None or step_of(p) <= newest) and owner(p) == run_id]
    for old in mine[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def foreign(directory: str | Path | None, run_id: str | None) -> list[Path]:
    """Readable snapshots in ``directory`` that run ``run_id`` did not write, newest first (a damaged
    snapshot is not another run's: ``--resume auto`` moves it aside)."""
    if not directory:
        return []
    return [p for p in snapshots(directory) if (who := owner(p)) is not _UNREADABLE and who != run_id]


def move_aside(path: Path) -> Path:
    """Rename a refused snapshot to ``step-N.bad-TIME-PID`` (kept for inspection, out of every count)."""
    aside = path.parent / f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    os.replace(path, aside)
    return aside


def read_meta(path: Path) -> dict:
    """A snapshot's ``meta.json``, after checking it is one: a :class:`DamagedSnapshot` otherwise."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise DamagedSnapshot(f"snapshot {path} has no meta.json (not a distlab snapshot, or not completely written)")
    try:
        if meta_path.stat().st_size > MAX_JSON_BYTES:
            raise ValueError(f"{meta_path.stat().st_size:,} bytes")
        meta = json.loads(confined(meta_path, f"snapshot {path}").read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DamagedSnapshot(f"snapshot {path}: meta.json is corrupt ({first_line(exc, 120)})") from None
    problem = _meta_problem(meta, path)
    if problem:
        raise DamagedSnapshot(f"snapshot {path}: meta.json is malformed ({problem})")
    return meta


def _meta_problem(meta, path: Path) -> str | None:
    """What makes ``meta`` not a snapshot description of this format (None: it is one)."""
    if not isinstance(meta, dict):
        return f"{with_article(type(meta).__name__)}, not an object"
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')!r}, this version reads {FORMAT}"
    step, world, files = meta.get("step"), meta.get("world_size"), meta.get("files")
    if not _is_int(step) or step < 0:
        return f"step {step!r} is not a step number"
    if STEP_DIR.match(path.name) and step_of(path) != step:
        return f"step {step} in the directory of step {step_of(path)}"
    if not _is_int(world) or world < 1:
        return f"world_size {world!r} is not a number of ranks"
    if not isinstance(files, dict):
        return f"files is {with_article(type(files).__name__)}, not an object"
    expected = [rank_file_name(r) for r in range(world)]
    if sorted(files) != expected:
        return f"files names {len(files)} rank file(s), world_size {world} needs {expected[0]} .. {expected[-1]}"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]) and _is_int(entry.get("bytes"))
                and entry["bytes"] >= 0):
            return f"the entry of {name} is not a sha256 and a byte count"
    if not isinstance(meta.get("run_id"), (str, type(None))):
        return "run_id is not a string"
    return None
