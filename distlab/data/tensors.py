"""``tensors:FILE``: your own inputs and labels, as a ``.pt`` or an ``.npz`` file.

A ``.pt`` file is a ``torch.save``d dict of tensors, read with ``weights_only=True``; an ``.npz``
is numpy's, read without pickles -- neither can run code. Keys: ``inputs`` (or ``x``, ``images``)
and ``labels`` (or ``y``, ``targets``); ``test_inputs`` / ``test_labels`` (or ``x_test`` /
``y_test``) if the file has its own test split, else a seeded 10% of the samples is held out
(the same on every rank and every run). Inputs are ``(N, C, H, W)``, ``(N, H, W)`` (one channel)
or ``(N, D)`` (one channel, one row); uint8 images are scaled like the built-in ones, floats are
standardised per channel with the training split's mean and standard deviation (both printed in
the header's data line). Labels are class indices ``0..K-1``. The samples then behave exactly as
a built-in data set's: the same sampler, resume position and resharding.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from distlab.data.dataset import ImageDataset
from distlab.errors import ConfigError, first_line, with_article

PREFIX = "tensors:"
TEST_FRACTION = 0.1
SPLIT_SEED = 0  # the held-out split does not depend on the run's seed: every run tests on the same samples
NAMES = {"inputs": ("inputs", "x", "images"), "labels": ("labels", "y", "targets"),
         "test_inputs": ("test_inputs", "x_test", "test_images"), "test_labels": ("test_labels", "y_test", "test_targets")}


def path_of(spec: str) -> Path:
    path = Path(spec[len(PREFIX):])
    if not str(path) or not path.is_file():
        raise ConfigError(f"--dataset {spec}: there is no file {path}")
    if path.suffix not in (".pt", ".pth", ".npz"):
        raise ConfigError(f"--dataset {spec}: give a .pt (torch.save of a dict of tensors) or an .npz file")
    return path


@functools.lru_cache(maxsize=4)
def _read(path: str, mtime: float) -> dict[str, torch.Tensor]:
    """The file's tensors by their canonical names (cached while the file is unchanged)."""
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                raw = {k: torch.from_numpy(np.ascontiguousarray(z[k])) for k in z.files}
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file: one line naming it
        raise ConfigError(f"--dataset tensors:{path}: cannot read it ({type(exc).__name__}: "
                          f"{first_line(exc, 200)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--dataset tensors:{path}: holds {with_article(type(raw).__name__)}, not a dict of tensors "
                          f"(save {{'inputs': x, 'labels': y}})")
    out = {}
    for name, keys in NAMES.items():
        key = next((k for k in keys if k in raw), None)
        if key is not None:
            if not torch.is_tensor(raw[key]):
                raise ConfigError(f"--dataset tensors:{path}: {key!r} is {with_article(type(raw[key]).__name__)}, not a tensor")
            out[name] = raw[key]
    for name in ("inputs", "labels"):
        if name not in out:
            raise ConfigError(f"--dataset tensors:{path}: no {' / '.join(NAMES[name])} among its keys "
                              f"({', '.join(map(str, raw)) or 'none'})")
    return out


def _images(x: torch.Tensor, path: Path, what: str) -> torch.Tensor:
    if x.ndim == 2:
        x = x[:, None, None, :]
    elif x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or not (x.dtype == torch.uint8 or x.is_floating_point()):
        raise ConfigError(f"--dataset tensors:{path}: {what} must be uint8 or floating point, (N, C, H, W), (N, H, W) "
                          f"or (N, D), not {x.dtype} {tuple(x.shape)}")
    return x


def _splits(spec: str):
    """(train inputs, train labels, test inputs, test labels, classes, mean, std) of ``spec``."""
    path = path_of(spec)
    t = _read(str(path), os.path.getmtime(path))
    x, y = _images(t["inputs"], path, "inputs"), t["labels"]
    if y.ndim != 1 or len(y) != len(x):
        raise ConfigError(f"--dataset {spec}: labels must be one class index per sample of inputs ({len(x)}), "
                          f"not {y.dtype} {tuple(y.shape)}")
    if "test_inputs" in t and "test_labels" in t:
        xt, yt = _images(t["test_inputs"], path, "test_inputs"), t["test_labels"]
    else:
        if len(y) < 2:
            raise ConfigError(f"--dataset {spec}: {len(y)} sample(s): too few to hold a test split out")
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
        held = max(1, int(len(y) * TEST_FRACTION))
        x, y, xt, yt = x[order[held:]], y[order[held:]], x[order[:held]], y[order[:held]]
    for inputs, labels, which in ((x, y, "inputs"), (xt, yt, "test_inputs")):
        if labels.ndim != 1 or len(labels) != len(inputs) or labels.is_floating_point() or labels.is_complex():
            raise ConfigError(f"--dataset {spec}: labels must be one class index per sample of {which} "
                              f"({len(inputs)}), not {labels.dtype} {tuple(labels.shape)}")
        if len(labels) and int(labels.min()) < 0:
            raise ConfigError(f"--dataset {spec}: labels must be class indices 0..K-1, not {int(labels.min())}")
    if tuple(x.shape[1:]) != tuple(xt.shape[1:]):
        raise ConfigError(f"--dataset {spec}: train inputs {tuple(x.shape[1:])} and test inputs "
                          f"{tuple(xt.shape[1:])} differ in shape")
    classes = int(max(int(y.max()) if len(y) else 0, int(yt.max()) if len(yt) else 0)) + 1
    scaled = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    mean = tuple(float(v) for v in scaled.mean(dim=(0, 2, 3)))
    std = tuple(max(float(v), 1e-6) for v in scaled.std(dim=(0, 2, 3)))
    return x, y.long(), xt, yt.long(), classes, mean, std


def load_tensors(spec: str, split: str) -> ImageDataset:
    x, y, xt, yt, classes, mean, std = _splits(spec)
    inputs, labels = (x, y) if split == "train" else (xt, yt)
    if inputs.is_floating_point():  # standardised here once (uint8 is scaled per batch, as on-disk images are)
        m = torch.tensor(mean).view(1, -1, 1, 1)
        s = torch.tensor(std).view(1, -1, 1, 1)
        inputs = ((inputs.float() - m) / s).contiguous()
    return ImageDataset(spec, split, inputs, labels, classes, mean, std, source=str(path_of(spec)))


def tensors_shape(spec: str) -> tuple[tuple[int, ...], int]:
    x, _, _, _, classes, _, _ = _splits(spec)
    return tuple(x.shape[1:]), classes
