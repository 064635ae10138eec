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
left to run eagerly (:func:`distlab.runtime.eager.eager` on the parallel parts' own modules and hooks):
the block is compiled in the pieces between them. Activation checkpointing recomputes the compiled
block. A model listing no blocks is compiled whole where nothing else wraps its insides.

**The whole model** is one graph where nothing acts inside it (:func:`whole_model`): one replica
or gradients reduced after backward (``allreduce``), no component, pipeline, checkpointing, ZeRO or
SyncBN -- the plain loop's ``model.compile()``, with no graph boundary between blocks.

The first step pays the compilation (seconds per distinct block on CPU; identical blocks share
one graph); evaluation and a last, smaller batch compile once more each.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.parallel.checkpointing import checkpoint_blocks
from distlab.runtime.eager import arm


BACKENDS = ("inductor", "aot_eager", "eager")  # torch.compile's: fused kernels, or the traced graphs run eagerly


def check(strategy) -> None:
    """``compile``'s own settings and what they meet, raising ConfigError: a backend without ``compile``, and
    the zero-bubble pipeline (whose weight gradients a compiled block fuses away). The backend's name is one of
    :data:`BACKENDS` (``Strategy.check``'s choices)."""
    if strategy.compile_backend != "inductor" and not strategy.compile:
        raise ConfigError(f"`compile_backend` {strategy.compile_backend} says how `compile` compiles: turn on "
                          f"`compile` too, or drop `compile_backend`")
    if strategy.pp_schedule == "zb" and strategy.compile:
        raise ConfigError("`pp_schedule` zb with `compile`: zero bubble takes each weight's gradient from the "
                          "product that reads it, which a compiled block fuses into one graph its weight pass cannot "
                          "start inside; use `pp_schedule` 1f1b "
                          "(or interleaved, `pp_virtual`) with `compile`, or drop `compile`")


def compile_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``compile`` compiles: every module of each of ``model``'s blocks; the model itself
    when it lists none."""
    try:
        blocks = checkpoint_blocks(model)
    except ConfigError:
        return [model]
    return [m for container, ranges in blocks for start, end in ranges for m in list(container)[start:end]]


def _builtin(m: nn.Module) -> bool:
    return type(m).__module__.startswith("torch.")


def _compile_builtin(m: nn.Module, backend: str) -> None:
    """``m.compile()`` for one of torch's own layers (``nn.Linear``, ``nn.Conv2d`` ...): dynamo does not
    trace a frame of torch's own files it is asked to start in (``nn.Module.compile`` of an ``nn.Linear``
    compiles nothing), but does inline them from one of distlab's -- so the compiled call starts here."""
    call_impl = m._call_impl

    def call(*args, **kwargs):
        return call_impl(*args, **kwargs)
    # a code object of its own per module: dynamo caches compiled code per code object, and one shared by
    # every layer would be recompiled for each until its cache limit, then run eagerly
    code = call.__code__.replace(co_name=f"compiled_{type(m).__name__}_{id(m):x}")
    m._compiled_call_impl = torch.compile(types.FunctionType(code, call.__globals__, code.co_name, None,
                                                             call.__closure__), backend=backend)


def whole_model(strategy, replicas: int, components: int) -> bool:
    """Whether ``strategy`` leaves the model's insides alone, so it compiles whole: no component, pipeline,
    activation checkpointing, ZeRO or SyncBN, and no gradient hook that must fire between blocks (one
    replica, or the ``allreduce`` sync after backward)."""
    return (not components and strategy.pp == 1 and not strategy.activation_checkpointing and not strategy.zero
            and strategy.sync_bn == "off" and (replicas == 1 or strategy.dp_sync == "allreduce"))


def apply_compile(model: nn.Module, whole: bool = False, backend: str = "inductor") -> int:
    """Compile ``model``'s blocks in place (``nn.Module.compile``) -- or, ``whole``, the model itself --
    with torch.compile's ``backend``; returns how many modules. A block module of torch's own classes is
    compiled through a frame of distlab's (:func:`_compile_builtin`), and only where it holds parameters (a
    ReLU or a Flatten alone is not worth a graph). The parallel parts' collectives and hooks become graph
    breaks first (:func:`distlab.runtime.eager.arm`)."""
    arm()
    if whole and not _builtin(model):
        model.compile(backend=backend)
        return 1
    modules = compiled_modules(model)
    for m in modules:
        if _builtin(m):
            _compile_builtin(m, backend)
        else:
            m.compile(backend=backend)
    return len(modules)


def compiled_modules(model: nn.Module) -> list[nn.Module]:
    """What :func:`apply_compile` compiles of ``model``: the model where it was compiled whole, else its
    blocks' modules, of torch's own classes only those holding parameters."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        return [model]
    return [m for m in compile_units(model) if not _builtin(m) or any(True for _ in m.parameters())]


def check_toolchain(device: torch.device, backend: str = "inductor") -> None:
    """Before any work: on a CPU, torch's inductor builds each compiled graph's kernels with a C++
    compiler (``$CXX``, else g++ or clang++ on PATH); without one the first step would fail deep inside
    it. Refused here in one line instead (the other backends build no kernel)."""
    import os
    import shutil
    if device.type != "cpu" or backend != "inductor":
        return
    cxx = os.environ.get("CXX")
    if (cxx and shutil.which(cxx)) or any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        return
    raise ConfigError("`compile` on a CPU needs a C++ compiler -- torch's inductor builds the compiled kernels with "
                      "one -- and none is on PATH (g++, clang++" + (f", or $CXX {cxx}" if cxx else ", or $CXX")
                      + "): install one (apt-get install g++), or train without `compile` or with "
                      "`compile_backend` aot_eager (traced, no fused kernels)")


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` has compiled in this process so far (dynamo's count of unique graphs)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])
