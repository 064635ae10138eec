"""``compile``: each block of the model through ``torch.compile``, in place.

Compiling the whole model would put everything the parallel layouts do around a block -- data
parallel's and ZeRO's gradient hooks, a pipeline stage's sends between layers, activation
checkpointing's recomputation -- inside one graph, where a collective or a hook either breaks the
graph or is traced wrongly. Compiling **each block** (a transformer block, a ResNet block, a VGG
stage's layers: the blocks :func:`~distlab.parallel.checkpointing.checkpoint_blocks` lists)
keeps those outside, torchtitan's way: the blocks' insides are fused, the layouts see the same
modules, parameters and ``state_dict`` keys (``nn.Module.compile`` compiles in place, no
``_orig_mod.`` prefix), so snapshots resume either way.

What composes: data parallel's buckets fire on the parameters' gradient hooks after a compiled
block's backward; ZeRO 1-2 reduce the same way; ZeRO-3's gathers, tensor and sequence parallel's
collectives, context parallel's ring and expert parallel's all-to-all run inside a block and are
left to run eagerly (:func:`torch.compiler.disable` on the parallel parts' own modules and hooks):
the block is compiled in the pieces between them. Activation checkpointing recomputes the compiled
block. A model listing no blocks is compiled whole where nothing else wraps its insides.

The first step pays the compilation (seconds per distinct block on CPU; identical blocks share
one graph); evaluation and a last, smaller batch compile once more each.
"""

from __future__ import annotations

import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.parallel.checkpointing import checkpoint_blocks


def compile_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``compile`` compiles: every module of each of ``model``'s blocks; the model itself
    when it lists none."""
    try:
        blocks = checkpoint_blocks(model)
    except ConfigError:
        return [model]
    return [m for container, ranges in blocks for start, end in ranges for m in list(container)[start:end]]


def apply_compile(model: nn.Module) -> int:
    """Compile ``model``'s blocks in place (``nn.Module.compile``); returns how many modules."""
    units = compile_units(model)
    for m in units:
        m.compile()
    return len(units)


def eager(fn):
    """``fn`` run as it is under ``torch.compile`` (a graph break around it): collectives, hooks that
    swap parameters, anything a compiled block must call rather than trace."""
    return torch.compiler.disable(fn, recursive=True)


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (dynamo's count of unique graphs)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
