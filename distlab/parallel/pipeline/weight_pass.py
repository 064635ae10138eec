"""Zero bubble's split backward: what its ``W`` pass starts from, so that it computes the weights' gradients
and nothing else.

``B`` computes the input's gradient and, on the way, the gradient of every tensor a weight's gradient is
taken from; ``W`` later runs backward from those tensors to the weights alone. Which tensors: the output
of each operation that reads a weight (:class:`WeightUses` sees them as the forward runs) -- a linear
layer's product, a norm's scaling, an expert's matmul -- the nearest point to the weight, so nothing
between it and the layer's output runs again in ``W``: not sequence parallel's reduce-scatter after a
row-parallel product, not expert parallel's combine after the experts (their backward is a collective; in
``W`` it would be sent a second time). A weight no operation was seen reading (one read inside a custom
autograd function, whose node the mode does not see) is taken from its module's output, every use of it
there with it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class WeightUses(TorchFunctionMode):
    """While active: ``found``, ``(output, weights)`` of each operation that read some of ``weights`` (the
    parameters that need a gradient) and gave a tensor that needs one."""

    def __init__(self, weights: list[nn.Parameter]):
        super().__init__()
        self.weights = {id(p): p for p in weights}
        self.found: list[tuple[torch.Tensor, list[nn.Parameter]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and id(a) in self.weights]
        if not read:
            return out
        if not torch.is_grad_enabled():  # inside a custom autograd function's forward: its node is not seen
            self.hidden.update(id(p) for p in read)
        elif isinstance(out, torch.Tensor) and out.requires_grad:
            self.found.append((out, list({id(p): p for p in read}.values())))
        return out

    hidden: set

    def __enter__(self):
        self.hidden = set()
        return super().__enter__()

    def uses(self) -> tuple[list[tuple[torch.Tensor, list[nn.Parameter]]], set[int]]:
        """The operations' ``(output, weights)`` of the weights only operations read, and the ids of those."""
        found = [(out, [p for p in ps if id(p) not in self.hidden]) for out, ps in self.found]
        found = [(out, ps) for out, ps in found if ps]
        return found, {id(p) for _, ps in found for p in ps}


def capture(owners: list[tuple[nn.Module, list[nn.Parameter]]]):
    """Context for one chunk's forward: yields ``found`` (filled when it exits) -- what ``W`` starts from,
    ``(tensor, weights)`` pairs: each operation's output that read a weight, and for a weight no operation
    was seen reading, its module's output."""
    return _Capture(owners)


class _Capture:
    def __init__(self, owners):
        self.owners = owners
        self.found: list[tuple[torch.Tensor, list[nn.Parameter]]] = []

    def __enter__(self):
        self.modules: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        self.hooks = [mod.register_forward_hook(
            lambda mod, a, out, own=own: self.modules.append((out, own))
            if isinstance(out, torch.Tensor) and out.requires_grad else None) for mod, own in self.owners]
        self.mode = WeightUses([p for _, own in self.owners for p in own])
        self.mode.__enter__()
        return self.found

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        for h in self.hooks:
            h.remove()
        found, seen = self.mode.uses()
        self.found += found
        for out, own in self.modules:  # weights read where no operation showed them: from the module's output
            rest = [p for p in own if id(p) not in seen]
            if rest:
                self.found.append((out, rest))
        return False


def weight_backward(pairs: list[tuple[torch.Tensor, list[nn.Parameter], torch.Tensor]]) -> None:
    """``W``: each weight's gradient from the ``(tensor, weights, gradient)`` triples ``B`` kept, accumulated
    into ``.grad`` once per weight -- a weight several operations read (an expert table indexed per expert)
    has their parts summed first, so a data-parallel bucket that launches when a gradient is ready never
    launches on a part of it."""
    uses: dict[int, int] = {}
    for _, own, _ in pairs:
        for p in own:
            uses[id(p)] = uses.get(id(p), 0) + 1
    summed: dict[int, list] = {}
    for out, own, grad in pairs:
        once = [p for p in own if uses[id(p)] == 1]
        more = [p for p in own if uses[id(p)] > 1]
        if more:
            for p, g in zip(more, torch.autograd.grad(out, more, grad, retain_graph=True, allow_unused=True)):
                if g is not None:
                    entry = summed.setdefault(id(p), [p, None])
                    entry[1] = g if entry[1] is None else entry[1] + g
        if once:  # from this tensor to these weights only
            torch.autograd.backward(out, grad, inputs=once)
    if summed:  # one accumulation each: the sum's gradient, through d(p . G)/dp = G exactly
        weights = [p for p, _ in summed.values()]
        torch.autograd.backward(sum((p * g.detach()).sum() for p, g in summed.values()), inputs=weights)
