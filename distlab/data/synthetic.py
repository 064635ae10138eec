"""``synthetic:CxHxW:K[:N]``: seeded data with a class signal in noise, for benchmarks and tests.

Each class ``k`` has a fixed prototype ``p_k``: a smooth random pattern (4 x 4 Gaussian values per
channel, upsampled bilinearly to H x W, then standardized), so convolutions find it as readily as
linear layers. A sample of class ``y`` is ``a * s * p_y + noise`` with unit Gaussian noise per
value, a per-sample strength ``s`` uniform in [0.5, 1.5], and ``a = SNR / sqrt(2 D)`` for ``D``
values per sample: two prototypes are ``SNR`` noise deviations apart whatever the shape. With
``SNR`` 5 a nearest-class-mean classifier gets ~85% of 10 classes and an MLP climbs over hundreds
of steps instead of reaching 100% at once -- learnable, not trivial, so methods can be compared
while they learn.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from distlab.data.dataset import ImageDataset
from distlab.errors import ConfigError

SPEC = re.compile(r"^synthetic:(\d+)x(\d+)x(\d+):(\d+)(?::(\d+))?$")
DEFAULT_TRAIN = 8192
SNR = 5.0


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
    coarse = torch.randn((k, shape[0], 4, 4), generator=gen)           # shared by both splits
    prototypes = F.interpolate(coarse, size=shape[1:], mode="bilinear", align_corners=False)
    flat = prototypes.flatten(1)
    prototypes = ((flat - flat.mean(1, keepdim=True)) / flat.std(1, keepdim=True).clamp_min(1e-6)).view_as(prototypes)
    gen.manual_seed(seed * 2 + (1 if split == "train" else 2))
    labels = torch.randint(0, k, (n,), generator=gen)
    strength = SNR / (2 * prototypes[0].numel()) ** 0.5 * (0.5 + torch.rand((n,) + (1,) * len(shape), generator=gen))
    images = strength * prototypes[labels] + torch.randn((n, *shape), generator=gen)
    return ImageDataset(spec, split, images, labels, k, (0.0,) * shape[0], (1.0,) * shape[0],
                        source="generated")
