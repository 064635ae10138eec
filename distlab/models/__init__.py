"""Models by name. Plain ``nn.Module``s: they know nothing of distribution.

``build_model(name, input_shape, num_classes, **options)``; names: ``mlp`` (``widths``),
``vgg11``, ``vgg11-bn``, ``vgg19``, ``vgg19-bn``, ``resnet18``, ``small-cnn-bn`` (two conv + BN
blocks, for fast checks). Adding one is a builder plus a
registry line.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from distlab.errors import ConfigError
from distlab.models.mlp import MLP
from distlab.models.resnet import ResNet18
from distlab.models.small_cnn import SmallCNN
from distlab.models.vgg import VGG

Builder = Callable[..., nn.Module]

REGISTRY: dict[str, Builder] = {
    "mlp": lambda shape, k, widths=(512, 256), **_: MLP(shape, k, tuple(widths)),
    "mlp-bn": lambda shape, k, widths=(512, 256), **_: MLP(shape, k, tuple(widths), batch_norm=True),
    "vgg11": lambda shape, k, **_: VGG(11, shape, k, batch_norm=False),
    "vgg11-bn": lambda shape, k, **_: VGG(11, shape, k, batch_norm=True),
    "vgg19": lambda shape, k, **_: VGG(19, shape, k, batch_norm=False),
    "vgg19-bn": lambda shape, k, **_: VGG(19, shape, k, batch_norm=True),
    "resnet18": lambda shape, k, **_: ResNet18(shape, k),
    "small-cnn-bn": lambda shape, k, **_: SmallCNN(shape, k, batch_norm=True),
}


def model_names() -> list[str]:
    return list(REGISTRY)


def check_model_name(name: str) -> str:
    if name not in REGISTRY:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(REGISTRY)}")
    return name


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options) -> nn.Module:
    return REGISTRY[check_model_name(name)](tuple(input_shape), num_classes, **options)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["MLP", "ResNet18", "SmallCNN", "VGG", "build_model", "check_model_name", "count_parameters", "model_names"]
