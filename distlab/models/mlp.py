"""Multilayer perceptron: flatten, then Linear + ReLU for each hidden width, then a Linear head
(``mlp-bn``: with a BatchNorm1d over the last hidden features, before the head)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.models import register
from distlab.models.contract import ModelContract, linear_plan
from distlab.models.plans import groups_starting_at
from distlab.models.spec import ModelSpec, Options, option


class MLP(ModelContract, nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...] = (512, 256),
                 batch_norm: bool = False):
        super().__init__()
        self.widths = tuple(widths)
        layers: list[nn.Module] = [nn.Flatten()]
        prev = math.prod(input_shape)
        for w in widths:
            layers += [nn.Linear(prev, w), nn.ReLU()]
            prev = w
        if batch_norm:
            layers.append(nn.BatchNorm1d(prev))
        layers.append(nn.Linear(prev, num_classes))
        self.net = nn.Sequential(*layers)

    def snapshot_record(self) -> dict:
        """The sizes a snapshot of this model must agree on (:mod:`distlab.models.plans`)."""
        return {"mlp_widths": list(self.widths)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def checkpoint_blocks(self):
        """Activation checkpointing's blocks: each Linear with what follows it."""
        return [(self.net, groups_starting_at(self.net, (nn.Linear,)))]

    def tensor_parallel_plan(self, tp: int, style: str, sequence_parallel: bool) -> dict[str, str]:
        """Tensor parallel's plan: the Linear layers paired as column then row parallel (megatron) or
        each gathered (naive); a left-over last Linear (the classifier) stays whole."""
        return linear_plan(self.net, "net", style)

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """The layers in order, under their names here (what a pipeline cuts into stages)."""
        return [(f"net.{i}", layer) for i, layer in enumerate(self.net)]


@dataclass(frozen=True)
class MLPOptions(Options):
    mlp_widths: tuple[int, ...] = option((512, 256), "Hidden widths of the MLP, comma-separated.", csv=True)

    def check(self) -> None:
        if not self.mlp_widths or any(w < 1 for w in self.mlp_widths):
            raise ConfigError(f"`mlp_widths` must be positive integers, not {self.mlp_widths}")


register(ModelSpec("mlp", lambda shape, k, o: MLP(shape, k, o.mlp_widths), MLPOptions))
register(ModelSpec("mlp-bn", lambda shape, k, o: MLP(shape, k, o.mlp_widths, batch_norm=True), MLPOptions))
