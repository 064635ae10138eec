"""``imagefolder:DIR``: your own images, one subfolder per class (torchvision's ImageFolder layout).

``DIR/train/<class>/*.png|jpg`` and ``DIR/test/<class>/...`` if both exist, else ``DIR/<class>/...``
with a seeded 10% of each class held out as the test split (the same on every rank and every run).
Classes are the subfolder names in sorted order (label ``i`` = the ``i``-th name); a class folder
without images, or a class in ``test/`` that ``train/`` lacks, is refused; entries named like images
that are not regular files are skipped, and the header says so (``notes``). Images are
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


def _classes(root: Path, spec: str, notes: list[str]) -> dict[str, list[Path]]:
    """Class name -> its image files. A class folder without images is refused (it would silently
    change the number of classes); entries named like images that are not regular files (a FIFO, a
    socket, a folder: reading them could block or fail) are skipped and noted; hidden folders are
    not classes."""
    found, skipped = {}, []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        named = sorted(p for p in d.iterdir() if p.suffix.lower() in SUFFIXES)
        skipped += [p for p in named if not p.is_file()]
        found[d.name] = [p for p in named if p.is_file()]
    if skipped:
        notes.append(f"skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} named like images that "
                     f"{'is' if len(skipped) == 1 else 'are'} not regular files: {', '.join(map(str, skipped[:3]))}"
                     + (" ..." if len(skipped) > 3 else ""))
    empty = [c for c, ps in found.items() if not ps]
    if empty and len(found) - len(empty) >= 2:
        raise ConfigError(f"--dataset {spec}: class folder{'s' if len(empty) > 1 else ''} "
                          f"{', '.join(str(root / c) for c in empty)} hold{'' if len(empty) > 1 else 's'} no images "
                          f"({', '.join(SUFFIXES)}): add some, or remove the folder")
    found = {k: v for k, v in found.items() if v}
    if len(found) < 2:
        raise ConfigError(f"--dataset {spec}: {root} needs one subfolder of images per class, at least two "
                          f"(found {len(found)} with images: {', '.join(found) or 'none'})")
    return found


def _decode(paths: list[Path], spec: str) -> np.ndarray:
    """The images as one uint8 array ``(N, C, H, W)``: grey if every one is, else RGB; one size."""
    from PIL import Image, UnidentifiedImageError

    def fail(path, exc):
        if isinstance(exc, Image.DecompressionBombError):
            return ConfigError(f"--dataset {spec}: {path} is too large to decode safely ({first_line(exc, 160)}): "
                               f"resize it")
        return ConfigError(f"--dataset {spec}: cannot read {path} ({type(exc).__name__}: {first_line(exc, 200)})")

    modes = []
    for path in paths:  # headers first (one file open at a time): the mode every image is decoded in
        try:
            with Image.open(path) as im:
                modes.append(im.mode)
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise fail(path, exc) from None
    mode = "L" if all(m in ("L", "1", "I;16") for m in modes) else "RGB"
    images, size = [], None
    for path in paths:
        try:
            with Image.open(path) as im:
                im = im.convert(mode)
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise fail(path, exc) from None
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
    """(train images, train labels, test images, test labels, class names, mean, std, notes)."""
    root = root_of(spec)
    notes: list[str] = []
    if (root / "train").is_dir() and (root / "test").is_dir():
        train, test = _classes(root / "train", spec, notes), _classes(root / "test", spec, notes)
        unseen = sorted(set(test) - set(train))
        if unseen:
            raise ConfigError(f"--dataset {spec}: class{'es' if len(unseen) > 1 else ''} {', '.join(unseen)} "
                              f"{'are' if len(unseen) > 1 else 'is'} in test/ but not in train/: the model would be "
                              f"scored on classes it never saw; add training images or remove them from test/")
        untested = sorted(set(train) - set(test))
        if untested:
            notes.append(f"class{'es' if len(untested) > 1 else ''} {', '.join(untested)} {'have' if len(untested) > 1 else 'has'} "
                         f"no test images: the test accuracy does not cover {'them' if len(untested) > 1 else 'it'}")
        names = sorted(train)
        pairs = {"train": [(p, names.index(c)) for c, ps in train.items() for p in ps],
                 "test": [(p, names.index(c)) for c, ps in test.items() for p in ps]}
    else:
        found = _classes(root, spec, notes)
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
    return x, y, xt, yt, tuple(names), mean, std, tuple(notes)


def load_imagefolder(spec: str, split: str) -> ImageDataset:
    x, y, xt, yt, names, mean, std, notes = _load(spec)
    images, labels = (x, y) if split == "train" else (xt, yt)
    return ImageDataset(spec, split, images, labels, len(names), mean, std, source=str(root_of(spec)),
                        class_names=names, notes=notes)


def imagefolder_shape(spec: str) -> tuple[tuple[int, ...], int]:
    x, _, _, _, names, _, _, _ = _load(spec)
    return tuple(x.shape[1:]), len(names)
