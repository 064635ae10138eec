"""ResNet-18 in its CIFAR form (He et al. 2015): a 3x3 stem without max-pool, four stages of two
basic blocks (64, 128, 256, 512 channels; stride 2 from the second stage), global average pool."""

from __future__ import annotations

from torch import nn

from distlab.models import register
from distlab.models.contract import ModelContract
from distlab.models.spec import ModelSpec


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(ModelContract, nn.Module):
    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True))
        stages, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512)):
            stages += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))

    def checkpoint_blocks(self):
        """Activation checkpointing's blocks: the stem, and each residual block."""
        return [(self.stem, [(0, len(self.stem))]), (self.layers, [(i, i + 1) for i in range(len(self.layers))])]

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The layers in order, under their names here (what a pipeline cuts into stages)."""
        return ([(f"stem.{i}", m) for i, m in enumerate(self.stem)] + [(f"layers.{i}", m) for i, m in enumerate(self.layers)]
                + [("pool", self.pool), ("flatten", nn.Flatten()), ("fc", self.fc)])


register(ModelSpec("resnet18", lambda shape, k, _: ResNet18(shape, k)))
