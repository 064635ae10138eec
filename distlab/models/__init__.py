"""Models by name. Plain ``nn.Module``s: they know nothing of distribution.

``build_model(name, input_shape, num_classes, **options)``; names: ``mlp`` (``widths``),
``vgg11``, ``vgg11-bn``, ``vgg19``, ``vgg19-bn``, ``resnet18``, ``small-cnn-bn`` (two conv + BN
blocks, for fast checks) for images; ``gpt`` (``n_layer``, ``n_head``, ``n_embd``; the block size
is the input shape) for text. Adding one is a builder plus a registry line.

:func:`task_loss` and :func:`task_correct` score either kind of output: a classifier's ``(B, K)``
logits against ``(B,)`` labels, or a language model's ``(B, T, V)`` logits against the ``(B, T)``
next tokens (mean over tokens: nats per token).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError
from distlab.models.gpt import GPT
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
    "gpt": lambda shape, k, n_layer=2, n_head=4, n_embd=128, **_: GPT(k, shape[0], n_layer, n_head, n_embd),
}
TEXT_MODELS = ("gpt",)


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


def task_loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy per sample (classifier) or per token (language model)."""
    if out.dim() == 3:
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction=reduction)
    return F.cross_entropy(out, y, reduction=reduction)


def task_correct(out: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(correct predictions, predictions): per sample, or per token for a language model."""
    return int((out.argmax(-1) == y).sum()), y.numel()


__all__ = ["GPT", "MLP", "ResNet18", "SmallCNN", "TEXT_MODELS", "VGG", "build_model", "check_model_name",
           "count_parameters", "model_names", "task_correct", "task_loss"]
