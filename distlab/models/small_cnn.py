"""A small convolutional network with batch norm: two conv blocks and a linear classifier.

Big enough to exercise what BatchNorm2d does in data parallel (per-channel statistics over
samples and positions) and small enough for equivalence checks on a CPU in seconds; the
default model of ``distlab verify``'s SyncBN case.
"""

from __future__ import annotations

from torch import nn

from distlab.models import register
from distlab.models.contract import ModelContract
from distlab.models.plans import groups_ending_after
from distlab.models.spec import ModelSpec


class SmallCNN(ModelContract, nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, channels: tuple[int, int] = (8, 16),
                 batch_norm: bool = True):
        super().__init__()
        c_in = input_shape[0]
        layers: list[nn.Module] = []
        for c_out in channels:
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batch_norm)]
            layers += [nn.BatchNorm2d(c_out)] if batch_norm else []
            layers += [nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c_in, num_classes)

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))

    def checkpoint_blocks(self):
        """Activation checkpointing's blocks: the stages of ``features`` (each ends at a pooling)."""
        return [(self.features, groups_ending_after(self.features, (nn.MaxPool2d,)))]

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The layers in order, under their names here (what a pipeline cuts into stages)."""
        return ([(f"features.{i}", m) for i, m in enumerate(self.features)]
                + [("pool", self.pool), ("flatten", nn.Flatten()), ("classifier", self.classifier)])


register(ModelSpec("small-cnn-bn", lambda shape, k, _: SmallCNN(shape, k, batch_norm=True)))
