"""VGG-11 / VGG-19 in their CIFAR form (Simonyan & Zisserman 2014; 3x3 convs, 32x32 inputs).

The convolutional stack is the paper's configuration A (VGG-11) or E (VGG-19), optionally with
batch norm after each convolution. For 32x32 inputs the five max-pools leave 512 x 1 x 1; smaller
inputs (28x28 Fashion-MNIST) skip the pools that would shrink a side below 1. The classifier is
two 512-wide hidden layers and the output layer (a pair of Linear layers that tensor parallel can
split column-then-row).
"""

from __future__ import annotations

from torch import nn

from distlab.models import register
from distlab.models.contract import ModelContract, linear_plan
from distlab.models.plans import groups_ending_after
from distlab.models.spec import ModelSpec

CONFIGS = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}


class VGG(ModelContract, nn.Module):
    def __init__(self, depth: int, input_shape: tuple[int, int, int], num_classes: int,
                 batch_norm: bool = False, hidden: int = 512):
        super().__init__()
        channels, h, w = input_shape
        layers: list[nn.Module] = []
        for v in CONFIGS[depth]:
            if v == "M":
                if min(h, w) >= 2:
                    layers.append(nn.MaxPool2d(2))
                    h, w = h // 2, w // 2
                continue
            layers.append(nn.Conv2d(channels, v, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(v))
            layers.append(nn.ReLU(inplace=True))
            channels = v
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)))

    def checkpoint_blocks(self):
        """Activation checkpointing's blocks: the stages of ``features`` (each ends at a pooling)."""
        return [(self.features, groups_ending_after(self.features, (nn.MaxPool2d,)))]

    def tensor_parallel_plan(self, tp: int, style: str, sequence_parallel: bool) -> dict[str, str]:
        """Tensor parallel's plan: the classifier's Linear layers (the convolutions stay whole)."""
        return linear_plan(self.classifier, "classifier", style)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The layers in order, under their names here (what a pipeline cuts into stages)."""
        return ([(f"features.{i}", m) for i, m in enumerate(self.features)] + [("pool", self.pool)]
                + [(f"classifier.{i}", m) for i, m in enumerate(self.classifier)])


register(ModelSpec("vgg11", lambda shape, k, _: VGG(11, shape, k)))
register(ModelSpec("vgg11-bn", lambda shape, k, _: VGG(11, shape, k, batch_norm=True)))
register(ModelSpec("vgg19", lambda shape, k, _: VGG(19, shape, k)))
register(ModelSpec("vgg19-bn", lambda shape, k, _: VGG(19, shape, k, batch_norm=True)))
