"""Each layer of a model alone, as a pipeline cuts it: its parameters, FLOPs, the bytes autograd saves for
backward and the bytes it hands the next layer (:func:`profile_layers`, run on the ``meta`` device by
:func:`distlab.plan.trace.trace`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from distlab.errors import ConfigError
from distlab.models import task_loss
from distlab.parallel.pipeline import sequential_layers
from distlab.plan.kernels import OpsTally


@dataclass(frozen=True)
class Layer:
    """One layer of the model as a pipeline cuts it (:func:`distlab.parallel.pipeline.sequential_layers`),
    per sample: its parameters, forward FLOPs, bytes autograd saves for backward (and of those, the
    bytes saved in LayerNorm and embedding regions, which tensor parallel replicates unless
    sequence parallel splits them), and the bytes of its output (what a stage boundary sends)."""
    name: str
    parameters: int
    forward_flops: float
    saved_bytes: float
    replicated_saved_bytes: float
    output_bytes: float
    ops_kept_bytes: float = 0.0  # checkpointed per op (ac_policy ops): the outputs of attention and of every
    ops_recompute_flops: float = 0.0  # other matrix multiplication kept; the FLOPs of the others, run again
    ops_kept_by: dict = field(default_factory=dict)  # of those kept bytes, each linear layer's (model name -> bytes)



def profile_layers(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None, out=None,
                   regions: set[str] = frozenset()) -> list[Layer]:
    """Each layer of ``model`` run alone on the meta device, in order, from input ``x``: what a
    pipeline stage of it computes, saves and sends (empty if the model is not a sequence of layers).
    With the targets ``y``, what the loss saves counts to the last layer (the last stage computes it), and ``out``
    (a :class:`~distlab.plan.trace.Trace`) learns what the loss saves and holds in its backward."""
    try:
        named = sequential_layers(model)
    except ConfigError:
        return []
    batch, layers, inside = x.shape[0], [], [0]
    hooks, seen, held = [], set(), []  # storages counted (once each, as a run's meter counts them), kept alive
    for name, m in model.named_modules():
        if isinstance(m, (nn.LayerNorm, nn.Embedding)) or name in regions:
            hooks.append(m.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, inside[0] + 1)))
            hooks.append(m.register_forward_hook(lambda m, a, o: inside.__setitem__(0, inside[0] - 1)))
    for name, layer in named:
        saved, replicated = [0], [0]
        params = {id(p) for p in layer.parameters()}

        def pack(t, saved=saved, replicated=replicated, params=params):
            if id(t) not in params and (t._base is None or id(t._base) not in params):  # weights stay anyway
                storage = t.untyped_storage()
                if storage._cdata not in seen:  # a view of a storage saved already (a transpose, a slice): no more
                    seen.add(storage._cdata)
                    held.append(t)
                    nbytes = storage.nbytes()
                    saved[0] += nbytes
                    replicated[0] += nbytes if inside[0] else 0
            return t

        ops = OpsTally()
        linear_hooks = [m.register_forward_pre_hook(lambda m, a, sub=sub: ops.enter(f"{name}.{sub}"))
                        for sub, m in layer.named_modules() if isinstance(m, nn.Linear)]
        linear_hooks += [m.register_forward_hook(lambda m, a, o: ops.enter(None))
                         for m in layer.modules() if isinstance(m, nn.Linear)]
        with FlopCounterMode(display=False) as flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops:
            x = layer(x)
        for h in linear_hooks:
            h.remove()
        layers.append(Layer(name, sum(p.numel() for p in layer.parameters()), flops.get_total_flops() / batch,
                            saved[0] / batch, replicated[0] / batch, x.numel() * x.element_size() / batch,
                            ops.kept_bytes / batch, ops.recompute_flops / batch,
                            {n: b / batch for n, b in ops.kept_by.items()}))
    for h in hooks:
        h.remove()
    if y is not None and layers:  # the loss's own (a language model's log-probabilities: as large as its logits)
        held, kept = [], []

        def hold(t):  # each storage once (the log-probabilities the softmax and the likelihood both save)
            storage = t.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                kept.append(t)
                held.append(storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(hold, lambda t: t):
            task_loss(x, y)
        layers[-1] = replace(layers[-1], saved_bytes=layers[-1].saved_bytes + sum(held) / batch)
        if out is not None and held:
            out.loss_bytes_per_sample = sum(held) / batch
            out.loss_grad_bytes_per_sample = 2 * max(held) / batch
    return layers
