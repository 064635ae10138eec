"""What distlab trusts in a Hugging Face directory: nothing it has not checked.

A downloaded directory is data written by someone else. Before anything in it is used:

* ``config.json`` is a JSON object of bounded depth, and every value a family reads is the type and range it
  must be (:class:`Config`: a size is a positive integer, ``rope_theta`` a finite positive number,
  ``tie_word_embeddings`` a JSON boolean, ``architectures`` a list of names) -- one line naming the key
  otherwise, never a ``KeyError`` or a division by zero;
* ``model.safetensors.index.json`` is an object whose ``weight_map`` maps names to plain relative file names
  inside the directory (no ``..``, no absolute path: nothing outside it is opened, nor asked whether it
  exists);
* every file read from it is inside it once its links are followed (:func:`confined`): a symbolic link out of
  the directory is refused before it is opened -- but for the hub's cache, whose snapshots link to its blobs;
* every weights file is read as safetensors from its header alone first (:func:`headers`): the header's
  length within the file and at most 100 MB, a JSON object of tensors each with a float dtype (F32, F16,
  BF16), a shape of non-negative integers and data offsets inside the file that fit that shape exactly; a
  tensor the index assigns to another file, or found in two, is refused;
* the model's own tensors are compared, by name and shape, with those headers before a byte is read or a
  tensor allocated (:func:`check_tensors`), and a config that claims more layers than the tensors hold is
  refused before the model is built (:func:`check_layers`);
* what is read is finite (a NaN or infinite weight is refused, naming the tensor).

Nothing in a directory is ever executed: no pickle (``pytorch_model.bin``), no ``auto_map`` code, templates
only in Jinja's sandbox (:mod:`distlab.data.chat`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path, PurePosixPath

import torch

from distlab.errors import ConfigError, confined

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HEADER_LIMIT = 100 * 1000 * 1000  # bytes: safetensors' own limit on a header
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_json(path: Path, where: str, kind: type = dict):
    """``path`` parsed as JSON of type ``kind``; one line naming it where it is not (binary, too deep, a link
    out of its directory, ...)."""
    confined(path, where)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path.name} is not text (UTF-8)") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {path.name} cannot be read ({exc.strerror or exc})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{where}: {path.name} is nested too deeply to be a configuration") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {path.name} is not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: {path.name} holds a JSON {type(value).__name__}, not a JSON "
                          f"{'object' if kind is dict else kind.__name__}")
    return value


class Config:
    """A ``config.json``'s values, each read as the type and range a family needs (one line otherwise)."""

    def __init__(self, values: dict, where: str):
        self.values, self.where = values, where

    def __contains__(self, key: str) -> bool:
        return self.values.get(key) is not None

    def _bad(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.where}: config.json's {key} is {self.values.get(key)!r}: {what}")

    def size(self, key: str, default: int | None = None, *alternatives: str, least: int = 1) -> int:
        """A positive integer (``least`` or more): ``key``'s value, else the first alternative key's, else
        ``default``; one line where none is given and there is no default."""
        for k in (key, *alternatives):
            value = self.values.get(k)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise self._bad(k, "it must be a whole number")
            if value < least:
                raise self._bad(k, f"it must be at least {least}")
            return value
        if default is None:
            raise ConfigError(f"{self.where}: config.json has no {key}, which the model's shape needs")
        return default

    def number(self, key: str, default: float, *alternatives: str, positive: bool = True) -> float:
        """A finite number (positive where ``positive``)."""
        for k in (key, *alternatives):
            value = self.values.get(k)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or (positive and value <= 0):
                raise self._bad(k, f"it must be a finite{' positive' if positive else ''} number")
            return float(value)
        return float(default)

    def flag(self, key: str, default: bool) -> bool:
        """A JSON boolean (``"false"``, a string, would read as true: it is refused)."""
        value = self.values.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(key, "it must be true or false")
        return value

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.values.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._bad(key, "it must be a string")
        return value

    def get(self, key: str, default=None):
        """The raw value (a key only compared, or checked by its reader)."""
        value = self.values.get(key)
        return default if value is None else value

    def architecture(self) -> str | None:
        value = self.values.get("architectures")
        if value is None:
            return None
        if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
            raise self._bad("architectures", "it must be a list of class names, as [\"LlamaForCausalLM\"]")
        return value[0]


def config_of(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"hf:{directory}: no config.json there (a Hugging Face model directory has config.json "
                          f"and model.safetensors, or shards with {INDEX})")
    return read_json(path, f"hf:{directory}")


def _inside(name, where: str) -> str:
    """``name`` if it is a plain relative file name inside the directory; one line otherwise."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: {INDEX}'s weight_map holds {name!r}, not a file name")
    path = PurePosixPath(name)
    if path.is_absolute() or "\\" in name or any(part in ("..", "") for part in name.split("/")) or \
            name.startswith("~"):
        raise ConfigError(f"{where}: {INDEX} names {name!r}, a file outside the directory: only files inside "
                          f"it are read")
    return name


def weight_map(directory: str | Path) -> dict[str, str] | None:
    """The index's ``{tensor: file}`` (every file a plain name inside the directory); None without an index."""
    root, where = Path(directory), f"hf:{directory}"
    if not (root / INDEX).is_file():
        return None
    index = read_json(root / INDEX, where)
    mapping = index.get("weight_map")
    if not isinstance(mapping, dict) or not mapping:
        raise ConfigError(f"{where}: {INDEX} has no weight_map object naming each tensor's file")
    for key, name in mapping.items():
        _inside(name, where)
    return mapping


def tensor_files(directory: str | Path) -> list[Path]:
    root, where = Path(directory), f"hf:{directory}"
    mapping = weight_map(directory)
    if mapping is not None:
        names = sorted(set(mapping.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ConfigError(f"{where}: {INDEX} lists {missing[0]}, which is not there")
        return [confined(root / n, where, root) for n in names]
    if (root / SINGLE).is_file():
        return [confined(root / SINGLE, where)]
    raise ConfigError(f"{where}: no {SINGLE} and no {INDEX} (only safetensors weights are read: a "
                      f"pytorch_model.bin is a pickle, which distlab never loads)")


def header(path: Path, where: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """One safetensors file's tensors, ``{name: (dtype, shape)}``, from its header alone -- checked against the
    file's size before the file is handed to the safetensors library."""
    what = f"{where}: {path.name}"
    size = confined(path, where).stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{what} is not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > min(HEADER_LIMIT, size - 8):  # (nothing of what it read is said: the file may be anything)
            raise ConfigError(f"{what} is not a safetensors file, or is cut short")
        raw = f.read(length)
    try:
        entries = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ConfigError(f"{what} is not a safetensors file: its header is not JSON") from None
    if not isinstance(entries, dict):
        raise ConfigError(f"{what} is not a safetensors file: its header is not a JSON object")
    data = size - 8 - length
    out = {}
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ConfigError(f"{what}: tensor {name!r} has no description")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in FLOATS:
            raise ConfigError(f"{what}: tensor {name} is {dtype!r}; a model's weights are floats "
                              f"({', '.join(FLOATS)})")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ConfigError(f"{what}: tensor {name} has shape {shape!r}, not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets):
            raise ConfigError(f"{what}: tensor {name} has data offsets {offsets!r}, not [begin, end]")
        nbytes = math.prod(shape) * FLOATS[dtype].itemsize
        if not 0 <= offsets[0] <= offsets[1] <= data or offsets[1] - offsets[0] != nbytes:
            raise ConfigError(f"{what}: tensor {name} ({dtype} {shape}) claims bytes {offsets[0]}-{offsets[1]} "
                              f"of {data:,}: the file is cut short or its header is wrong")
        out[name] = (FLOATS[dtype], tuple(shape))
    return out


def headers(directory: str | Path) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...]]]:
    """Every tensor of the directory, ``{name: (file, dtype, shape)}``, from the headers alone; a tensor in two
    files, or in a file the index does not assign it to, is refused."""
    where, mapping = f"hf:{directory}", weight_map(directory)
    out: dict[str, tuple[Path, torch.dtype, tuple[int, ...]]] = {}
    for path in tensor_files(directory):
        for name, (dtype, shape) in header(path, where).items():
            if name in out:
                raise ConfigError(f"{where}: tensor {name} is in both {out[name][0].name} and {path.name}")
            if mapping is not None and mapping.get(name) != path.name:
                raise ConfigError(f"{where}: {path.name} holds {name}, which {INDEX} puts in "
                                  f"{mapping.get(name) or 'no file'}")
            out[name] = (path, dtype, shape)
    return out


def check_layers(layers: int, names, where: str) -> None:
    """Before a model is built: its config's ``layers`` must be no more than the checkpoint's tensor names
    number (the largest index in them, plus one) -- a config claiming a million layers builds nothing."""
    found = max((int(n) for name in names for n in re.findall(r"\.(\d+)\.", f".{name}.")), default=-1) + 1
    if layers > max(found, 1):
        raise ConfigError(f"{where}: config.json says {layers} layers, but its tensors number at most {found}")


def check_tensors(mine: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]], lead: str,
                  says: str = "its config says") -> None:
    """The model's tensor shapes (distlab's names) against a checkpoint's, before anything is read into it:
    one line starting ``lead`` (``hf:DIR does not match its config``) naming the first difference."""
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing or extra:
        raise ConfigError(f"{lead}: "
                          + (f"{len(missing)} tensor(s) missing (first {missing[0]})" if missing else "")
                          + ("; " if missing and extra else "")
                          + (f"{len(extra)} unexpected (first {extra[0]})" if extra else ""))
    for key, shape in theirs.items():
        if tuple(shape) != tuple(mine[key]):
            raise ConfigError(f"{lead}: {key} has shape {tuple(shape)}, {says} {tuple(mine[key])}")


def finite(tensor: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """``tensor``, if every value is finite; one line naming it otherwise."""
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ConfigError(f"{where}: tensor {name} holds NaN or infinite values")
    return tensor


__all__ = ["Config", "FLOATS", "INDEX", "SINGLE", "check_layers", "check_tensors", "config_of", "finite", "header",
           "headers", "read_json", "tensor_files", "weight_map"]
