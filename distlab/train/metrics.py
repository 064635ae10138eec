"""Run outputs: ``metrics.jsonl`` (one object per log step) and ``summary.json`` (DESIGN.md contract).

Written by rank 0 only. ``summary.json`` is replaced atomically (temp file, fsync, rename), so a
reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import tempfile
from pathlib import Path

import torch

from distlab.errors import WriteError


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (temp file, fsync, rename): a reader sees the old file or the new
    one. A failure (a full or read-only disk) is a :class:`~distlab.errors.WriteError` naming the file;
    nothing partial is left."""
    path = Path(path)
    try:
        _atomic_write_text(path, text)
    except WriteError:
        raise
    except OSError as exc:
        raise WriteError(path, exc) from None


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def strict(obj):
    """``obj`` with every non-finite float (nan, inf) replaced by None: strict JSON, which every
    parser reads (Python's json would write the non-standard ``NaN`` and ``Infinity``)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj, **kw) -> str:
    """Strict JSON text of ``obj`` (:func:`strict`)."""
    return json.dumps(strict(obj), allow_nan=False, **kw)


class MetricsLog:
    """Appends one JSON line per log step to ``DIR/metrics.jsonl`` (no-op when ``directory`` is None)."""

    def __init__(self, directory: str | Path | None, records: list[dict] = ()):
        """Start the file afresh with ``records`` (a resumed run's history up to its snapshot); a run
        with none makes it at its first record (one that fails before logging a step leaves no file)."""
        self.path = Path(directory) / "metrics.jsonl" if directory else None
        if self.path and (records or self.path.exists()):
            atomic_write_text(self.path, "".join(dumps(r) + "\n" for r in records))

    def touch(self) -> None:
        """Make the file if no record has (a run that ends before its first log step: its summary comes
        with a metrics.jsonl, empty)."""
        if self.path and not self.path.exists():
            atomic_write_text(self.path, "")

    def write(self, record: dict) -> None:
        if self.path:
            try:
                with open(self.path, "a") as f:
                    f.write(dumps(record) + "\n")
            except OSError as exc:
                raise WriteError(self.path, exc) from None


def write_summary(directory: str | Path, summary: dict) -> Path:
    path = Path(directory) / "summary.json"
    atomic_write_text(path, dumps(summary, indent=2) + "\n")
    return path


def write_predictions(directory: Path, test_set, step: int, confusion, misclassified: list) -> str:
    """``DIR/predictions.npz`` (atomically): the last evaluation's confusion matrix (row: true label,
    column: prediction) and its first misclassified test samples -- the images as the data set holds
    them, their labels and predictions, their indices -- and the class names. Plain arrays, read with
    ``numpy.load(allow_pickle=False)``; ``distlab report`` draws them. Returns the file's name."""
    import numpy as np
    rows = np.asarray(misclassified, dtype=np.int64).reshape(-1, 3)
    idx = torch.as_tensor(rows[:, 0], dtype=torch.long)
    images = test_set.images[idx.to(test_set.images.device)].cpu().numpy() if len(rows) else \
        np.zeros((0, *test_set.input_shape), dtype=np.uint8)
    names = test_set.class_names or tuple(str(i) for i in range(test_set.num_classes))
    path = Path(directory) / "predictions.npz"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, step=np.int64(step), confusion=confusion.numpy().astype(np.int64), images=images,
                            labels=rows[:, 1], predictions=rows[:, 2], indices=rows[:, 0],
                            class_names=np.asarray(names, dtype=str))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.name


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (Linux reports ru_maxrss in KiB): everything its page
    tables mapped at once -- file pages too, such as a memory-mapped corpus's that the kernel caches and
    can drop (see :func:`anon_rss_mb`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_ANON_PEAK = [0.0]  # the largest anon_rss_mb() read in this process


def anon_rss_mb() -> float | None:
    """This process's anonymous resident memory in MB now (``RssAnon`` of ``/proc/self/status``): what it
    allocated itself -- tensors, the optimizer, the interpreter -- not file pages it maps (a memory-mapped
    corpus, the libraries), which count in RSS while cached and the kernel reclaims under pressure.
    Also kept as the peak of every reading (:func:`anon_peak_mb`); None where ``/proc`` has no such line."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    mb = int(line.split()[1]) / 1024.0
                    _ANON_PEAK[0] = max(_ANON_PEAK[0], mb)
                    return mb
    except OSError:
        pass
    return None


def anon_peak_mb() -> float | None:
    """The largest anonymous resident memory read so far (:func:`anon_rss_mb`, read now too): a peak over
    the moments it was read -- a run reads it after its first step, at every log line and evaluation and
    at the end -- where the kernel keeps no peak of its own."""
    return None if anon_rss_mb() is None else _ANON_PEAK[0]


def median_excluding_warmup(times: list[float], warmup: int) -> float | None:
    """Median step time without the first ``warmup`` steps (fewer if the run is short)."""
    if not times:
        return None
    skip = min(warmup, len(times) // 2)
    return statistics.median(times[skip:])
