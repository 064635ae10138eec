"""One run per snapshot directory: an exclusive ``flock`` on ``DIR/.distlab-lock``.

Two runs that share a ``--snapshot-dir`` would prune each other's snapshots and collide on the
same ``.tmp-step-N`` directory. The lock is taken before anything is launched -- by the command
that launches the workers (they run under it and die with it), or by rank 0 of a job whose
launcher is not distlab's -- and held until the run ends. The operating system drops it when the
holder dies, however it dies: a lock file left behind by a killed run never blocks the next one.

The file names the holder (host, pid, run id, start time), so a second run is refused with a line
that says who has the directory.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from distlab.errors import ConfigError
from distlab.runtime.launch import parent_pid

NAME = ".distlab-lock"
PROBE_BYTES = 64 * 1024  # what check_writable writes: a disk without that much room is refused before launch
_ENV = "DISTLAB_HELD_LOCKS"  # set by a launching command: the directories it holds, for its workers

_held: dict[str, int] = {}  # this process's locks: directory (resolved) -> open descriptor
_made: set[str] = set()  # the directories hold() created (removed again if the run leaves nothing in them)


class DirectoryLocked(ConfigError):
    """Another live run holds the directory."""


def _key(directory: str | Path) -> str:
    return str(Path(directory).resolve())


def held_by_launcher(directory: str | Path) -> bool:
    """Whether this process's parent (the distlab command that launched it) holds ``directory``'s lock."""
    spec = os.environ.get(_ENV, "")
    pid, _, dirs = spec.partition(":")
    return bool(pid) and pid == str(parent_pid()) and _key(directory) in dirs.split(os.pathsep)


def holder(directory: str | Path) -> dict:
    """What the lock file says about its holder (empty when it says nothing readable)."""
    try:
        info = json.loads((Path(directory) / NAME).read_text()[:4096])
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict) -> str:
    parts = [f"run id {info['run_id']}" if info.get("run_id") else None,
             f"pid {info['pid']} on host {info.get('host', '?')}" if info.get("pid") else None,
             f"since {info['since']}" if info.get("since") else None]
    return ", ".join(p for p in parts if p) or "holder unknown"


def _write(directory: str | Path, info: dict) -> None:
    with contextlib.suppress(OSError):  # the lock holds whether or not its label could be written
        with open(Path(directory) / NAME, "r+") as f:
            f.truncate(0)
            f.write(json.dumps(info) + "\n")


def check_writable(directory: str | Path | None, flag: str) -> None:
    """Before launching: ``directory`` is (or can be made) a directory this process can write into --
    not a file, not on a read-only file system. Tried for real (a probe file made and removed in the
    nearest existing directory), since permission bits do not tell a root user or a read-only mount.
    Nothing is created."""
    if not directory:
        return
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"`{flag}` {directory} is a file, not a directory: give a directory")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"`{flag}` {directory} cannot be made: {probe} is a file")
    try:  # real bytes, synced: an empty file can still be made on a full disk
        fd, name = tempfile.mkstemp(prefix=".distlab-probe-", dir=probe)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        raise ConfigError(f"`{flag}` {directory} cannot be written ({probe}: {exc.strerror or exc}): give a writable "
                          f"directory") from None


def hold(directory: str | Path | None, run_id: str | None = None, flag: str = "snapshot_dir",
         export_to_children: bool = False) -> bool:
    """Take ``directory``'s lock for this process (idempotent); True if this call took it.

    Nothing to do when this process or its launcher already holds it. Raises :class:`DirectoryLocked`
    naming the holder when another process does, and :class:`ConfigError` when the directory
    cannot be made or written. ``export_to_children``: tell processes started from here (the
    workers) that the lock is held for them.
    """
    if not directory:
        return False
    key = _key(directory)
    if key in _held or held_by_launcher(directory):
        return False
    path = Path(directory)
    try:
        made = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"`{flag}` {directory} cannot be used: {exc.strerror or exc} (errno {exc.errno}); give a "
                          f"writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryLocked(f"`{flag}` {directory} is in use by another run ({_describe(holder(directory))}): "
                              f"wait for it to end, or give this run its own `{flag}`") from None
    _held[key] = fd
    if made:
        _made.add(key)
    if len(_held) == 1:
        atexit.register(release_all)  # a launching command that fails: its directories are tidied too
    _write(directory, {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    if export_to_children:
        dirs = [d for d in os.environ.get(_ENV, "").partition(":")[2].split(os.pathsep) if d]
        os.environ[_ENV] = f"{os.getpid()}:{os.pathsep.join(dirs + [key])}"
    return True


def note_run(directory: str | Path | None, run_id: str | None) -> None:
    """Write the run id into the lock file once it is known (by this process's or its launcher's lock)."""
    if directory and (_key(directory) in _held or held_by_launcher(directory)):
        info = holder(directory)
        _write(directory, {**info, "run_id": run_id})


def release(directory: str | Path | None) -> None:
    """Drop this process's lock on ``directory`` (the file stays: it is only a label) -- unless
    :func:`hold` made the directory and the run left nothing else in it (it failed before its first
    step): then the lock file and the directory go, while still locked, so the same command can run
    again into the same directory and nothing empty is listed as a run."""
    if not directory:
        return
    key = _key(directory)
    fd = _held.pop(key, None)
    if fd is not None and key in _made:
        _made.discard(key)
        with contextlib.suppress(OSError):
            if [p.name for p in Path(key).iterdir()] == [NAME]:
                os.unlink(Path(key) / NAME)
                os.rmdir(key)
    if fd is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def release_each(directories) -> None:
    """Release these directories' locks, and stop telling processes started from here that they are held."""
    keys = {_key(d) for d in directories}
    for key in keys:
        release(key)
    pid, _, dirs = os.environ.get(_ENV, "").partition(":")
    if pid == str(os.getpid()):
        left = [d for d in dirs.split(os.pathsep) if d and d not in keys]
        if left:
            os.environ[_ENV] = f"{pid}:{os.pathsep.join(left)}"
        else:
            os.environ.pop(_ENV, None)


def release_all() -> None:
    """Release every lock this process holds (at exit)."""
    for key in list(_held):
        release(key)
