"""``synthetic:CxHxW:K[:N]``: seeded Gaussian data with a learnable signal, for benchmarks and tests.

Each class ``k`` has a fixed random prototype ``p_k``; a sample of class ``y`` is ``p_y + noise``
with noise of standard deviation 2, so a linear model can learn it but not instantly.
"""

from __future__ import annotations

import re

import torch

from distlab.data.dataset import ImageDataset
from distlab.errors import ConfigError

SPEC = re.compile(r"^synthetic:(\d+)x(\d+)x(\d+):(\d+)(?::(\d+))?$")
DEFAULT_TRAIN = 8192


def parse_spec(spec: str) -> tuple[tuple[int, int, int], int, int]:
    m = SPEC.match(spec)
    if not m or min(int(g) for g in m.groups()[:4]) < 1:
        raise ConfigError(f"bad synthetic dataset {spec!r}: write synthetic:CxHxW:CLASSES[:N], "
                          f"e.g. synthetic:1x28x28:10 or synthetic:3x32x32:10:4096")
    c, h, w, k = (int(g) for g in m.groups()[:4])
    if k < 2:
        raise ConfigError(f"synthetic dataset {spec!r} needs at least 2 classes")
    return (c, h, w), k, int(m.group(5) or DEFAULT_TRAIN)


def make_synthetic(spec: str, split: str, seed: int = 0) -> ImageDataset:
    shape, k, n_train = parse_spec(spec)
    n = n_train if split == "train" else max(1, n_train // 4)
    gen = torch.Generator().manual_seed(seed)
    prototypes = torch.randn((k, *shape), generator=gen)           # shared by both splits
    gen.manual_seed(seed * 2 + (1 if split == "train" else 2))
    labels = torch.randint(0, k, (n,), generator=gen)
    images = prototypes[labels] + 2.0 * torch.randn((n, *shape), generator=gen)
    return ImageDataset(spec, split, images, labels, k, (0.0,) * shape[0], (1.0,) * shape[0],
                        source="generated")
