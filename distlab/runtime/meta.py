"""Tensors built on the meta device (shapes, no memory): whether a module has values yet, and how one of its
tensors takes a value in place once a rank knows its part (:mod:`distlab.models.deferred`)."""

from __future__ import annotations

import torch
from torch import nn


def adopt(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``tensor`` (a parameter or buffer built on the meta device) ``value``'s storage in place: the same
    Python object, its attributes and its gradient hooks kept (a gradient sync registered them on it)."""
    attrs = dict(tensor.__dict__)
    hooks = (tensor._post_accumulate_grad_hooks, tensor._backward_hooks)
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, value)
    tensor.__dict__.update(attrs)
    if hooks[0] is not None:
        tensor._post_accumulate_grad_hooks = hooks[0]  # registers them on the new storage's autograd node
    if hooks[1] is not None:
        tensor._backward_hooks = hooks[1]


def on_meta(module: nn.Module) -> bool:
    """Whether ``module`` was built on the meta device and has no values yet."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


__all__ = ["adopt", "on_meta"]
