"""Readers for CIFAR-10 / CIFAR-100 in their "python version" layout.

``cifar-10-batches-py/{data_batch_1..5, test_batch}`` and ``cifar-100-python/{train, test}``:
pickled dicts with ``data`` (N x 3072 uint8, channel-major 3x32x32) and ``labels`` (CIFAR-10) or
``fine_labels`` (CIFAR-100). The files are pickles, so they are read with an unpickler that
only rebuilds plain containers and numpy arrays: a tampered file cannot run code.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np

from distlab.errors import ConfigError

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}

LAYOUTS = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "labels", 10),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "fine_labels", 100),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _load_batch(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = _SafeUnpickler(io.BytesIO(f.read()), encoding="latin1").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read CIFAR batch {path}: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} is not a CIFAR batch (a {type(obj).__name__}, not a dict)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def read_cifar(directory: Path, name: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N,3,32,32) uint8, labels (N,) int64)`` of one split from ``directory``."""
    _, train_files, test_files, label_key, num_classes = LAYOUTS[name]
    images, labels = [], []
    for fname in train_files if split == "train" else test_files:
        batch = _load_batch(directory / fname)
        if "data" not in batch or label_key not in batch:
            raise ConfigError(f"{directory / fname} lacks 'data' or '{label_key}'")
        data = np.asarray(batch["data"], dtype=np.uint8)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ConfigError(f"{directory / fname}: data has shape {data.shape}, expected (N, 3072)")
        lab = np.asarray(batch[label_key], dtype=np.int64)
        if len(lab) != len(data) or (len(lab) and (lab.min() < 0 or lab.max() >= num_classes)):
            raise ConfigError(f"{directory / fname}: {len(lab)} labels for {len(data)} images, "
                              f"or a label outside 0..{num_classes - 1}")
        images.append(data.reshape(-1, 3, 32, 32))
        labels.append(lab)
    return np.concatenate(images), np.concatenate(labels)


def write_cifar_batch(path: Path, images: np.ndarray, labels: np.ndarray, label_key: str = "labels") -> None:
    """Write a batch in the real on-disk format (a protocol-2 pickle with bytes keys, as CIFAR ships)."""
    obj = {b"batch_label": b"distlab", label_key.encode(): [int(x) for x in labels],
           b"data": np.ascontiguousarray(images, dtype=np.uint8).reshape(len(images), -1),
           b"filenames": [f"{i}.png".encode() for i in range(len(images))]}
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)
