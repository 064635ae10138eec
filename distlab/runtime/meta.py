"""Tensors built on the meta device (shapes, no memory): whether a module has values yet, and how one of its
tensors takes a value in place once a rank knows its part (:mod:`distlab.models.deferred`)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# In-place operations whose result does not depend on the tensor's previous values.
OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "geometric_", "log_normal_",
              "cauchy_"}


def unfilled(func, args) -> bool:
    """Whether ``func(*args)`` only fills a meta tensor with values (an initialisation): on the meta device there
    are none, and running it anyway is torch's Python reference of it (``normal_``: 0.7 ms a tensor, most of a
    model's meta build). It draws nothing there either: the random state is the same skipped or run."""
    return (func._schema.is_mutable and func._schema.name.split("::")[-1] in OVERWRITES and bool(args)
            and torch.is_tensor(args[0]) and args[0].device.type == "meta")


class _Unfilled(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return args[0] if unfilled(func, args) else func(*args, **(kwargs or {}))


@contextlib.contextmanager
def on_meta_device():
    """Context: tensors made on the meta device (``torch.device("meta")``), their initialisations skipped
    (:func:`unfilled`) -- a model built for its shapes alone."""
    with torch.device("meta"), _Unfilled():
        yield


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


__all__ = ["OVERWRITES", "adopt", "on_meta", "on_meta_device", "unfilled"]
