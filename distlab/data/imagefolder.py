"""``imagefolder:DIR``: your own images, one subfolder per class (torchvision's ImageFolder layout).

``DIR/train/<class>/*.png|jpg`` and ``DIR/test/<class>/...`` if both exist, else ``DIR/<class>/...``
with a seeded 10% of each class held out as the test split (the same on every rank and every run).
Classes are the subfolder names in sorted order (label ``i`` = the ``i``-th name). Images are
decoded with Pillow, as grey (``L``) if every one is, else as RGB, and must share one size (resize
them first; a different one is named). They stay uint8 in memory; the per-channel mean and
standard deviation of the training split are computed once and printed in the header, and every
batch is normalised with them, as the built-in image sets are.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from distlab.data.dataset import ImageDataset
from distlab.errors import ConfigError, first_line

PREFIX = "imagefolder:"
SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
TEST_FRACTION = 0.1
SPLIT_SEED = 0


def root_of(spec: str) -> Path:
    root = Path(spec[len(PREFIX):])
    if not str(spec[len(PREFIX):]) or not root.is_dir():
        raise ConfigError(f"--dataset {spec}: there is no directory {root}")
    return root


def _classes(root: Path, spec: str) -> dict[str, list[Path]]:
    found = {d.name: sorted(p for p in d.iterdir() if p.suffix.lower() in SUFFIXES)
             for d in sorted(root.iterdir()) if d.is_dir()}
    found = {k: v for k, v in found.items() if v}
    if len(found) < 2:
        raise ConfigError(f"--dataset {spec}: {root} needs one subfolder of images per class, at least two "
                          f"(found {len(found)} with images: {', '.join(found) or 'none'})")
    return found


def _decode(paths: list[Path], spec: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError
    images, mode, size = [], None, None
    try:
        opened = [Image.open(p) for p in paths]
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"--dataset {spec}: cannot read an image ({type(exc).__name__}: {first_line(exc, 200)})") \
            from None
    mode = "L" if all(im.mode in ("L", "1", "I;16") for im in opened) else "RGB"
    for path, im in zip(paths, opened):
        try:
            im = im.convert(mode)
        except OSError as exc:
            raise ConfigError(f"--dataset {spec}: cannot decode {path} ({first_line(exc, 200)})") from None
        if size is None:
            size = im.size
        elif im.size != size:
            raise ConfigError(f"--dataset {spec}: {path} is {im.size[0]}x{im.size[1]}, the others "
                              f"{size[0]}x{size[1]}: give every image one size")
        a = np.asarray(im, dtype=np.uint8)
        images.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
    return np.stack(images)


@functools.lru_cache(maxsize=4)
def _load(spec: str):
    """(train images, train labels, test images, test labels, class names, mean, std)."""
    root = root_of(spec)
    if (root / "train").is_dir() and (root / "test").is_dir():
        train, test = _classes(root / "train", spec), _classes(root / "test", spec)
        names = sorted(set(train) | set(test))
        pairs = {"train": [(p, names.index(c)) for c, ps in train.items() for p in ps],
                 "test": [(p, names.index(c)) for c, ps in test.items() for p in ps]}
    else:
        found = _classes(root, spec)
        names = sorted(found)
        pairs = {"train": [], "test": []}
        g = torch.Generator().manual_seed(SPLIT_SEED)
        for label, c in enumerate(names):  # per class: the test split has every class in proportion
            order = torch.randperm(len(found[c]), generator=g).tolist()
            held = max(1, int(len(order) * TEST_FRACTION)) if len(order) > 1 else 0
            pairs["test"] += [(found[c][i], label) for i in order[:held]]
            pairs["train"] += [(found[c][i], label) for i in order[held:]]
    if not pairs["test"]:
        raise ConfigError(f"--dataset {spec}: too few images to hold a test split out (give DIR/train and DIR/test)")
    decoded = _decode([p for p, _ in pairs["train"] + pairs["test"]], spec)
    n = len(pairs["train"])
    x, xt = torch.from_numpy(decoded[:n]), torch.from_numpy(decoded[n:])
    y = torch.tensor([label for _, label in pairs["train"]])
    yt = torch.tensor([label for _, label in pairs["test"]])
    scaled = x.float() / 255.0
    mean = tuple(float(v) for v in scaled.mean(dim=(0, 2, 3)))
    std = tuple(max(float(v), 1e-6) for v in scaled.std(dim=(0, 2, 3)))
    return x, y, xt, yt, tuple(names), mean, std


def load_imagefolder(spec: str, split: str) -> ImageDataset:
    x, y, xt, yt, names, mean, std = _load(spec)
    images, labels = (x, y) if split == "train" else (xt, yt)
    return ImageDataset(spec, split, images, labels, len(names), mean, std, source=str(root_of(spec)),
                        class_names=names)


def imagefolder_shape(spec: str) -> tuple[tuple[int, ...], int]:
    x, _, _, _, names, _, _ = _load(spec)
    return tuple(x.shape[1:]), len(names)
