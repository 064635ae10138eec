"""Reader for the IDX format of MNIST and Fashion-MNIST (``*-idx3-ubyte`` / ``*-idx1-ubyte``, gz or raw).

IDX layout (big-endian): two zero bytes, a type code (0x08 = uint8), the number of dimensions
``d``, then ``d`` uint32 sizes, then the data in C order.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from distlab.errors import ConfigError

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file into a numpy array of its stored shape and type."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise ConfigError(f"cannot read IDX file {path}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ConfigError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()})")
    dtype, ndim = np.dtype(_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ConfigError(f"{path} is truncated or corrupt: header says {shape} "
                          f"({expected} bytes of data), file has {len(raw) - header}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file; gzip-compressed if the name ends in ``.gz``."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def find_idx_pair(directory: Path, prefix: str) -> tuple[Path, Path] | None:
    """``(images, labels)`` for ``prefix`` in ("train", "t10k") in ``directory``, gz or raw."""
    found = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        for name in (f"{prefix}-{kind}.gz", f"{prefix}-{kind}"):
            if (directory / name).is_file():
                found.append(directory / name)
                break
        else:
            return None
    return found[0], found[1]
