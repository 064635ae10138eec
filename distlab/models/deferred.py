"""A model built on the meta device, its values given later one tensor at a time.

``model, init = deferred(lambda: build_model(...))`` runs the builder once with every tensor on the meta
device (shapes, no memory) while it notes each operation that makes or fills one: ``torch.empty`` then
``uniform_`` (an ``nn.Linear``), ``normal_`` (a decoder's re-initialisation), ``ones`` (a norm's weight).
:meth:`Initialisation.tensors` later replays those operations on the CPU in the same order, from the
random state the build started in, so every tensor gets the values a real build gives it (bitwise) and the
random state ends where a real build leaves it -- but a tensor is made only from its last full
overwrite on (an ``nn.Linear``'s first ``uniform_`` that the decoder's ``normal_`` replaces only draws
its random numbers, into a scratch tensor dropped at once) and handed over as soon as its last operation
ran. Holding a tensor only while it is made and cut, a rank's peak is its part plus the largest tensor,
never the whole model (:func:`distlab.parallel.placement.state_from_stream`).

A builder that does anything else to a tensor that ends in the model -- computes it from another one,
fills part of it, makes it on a real device -- cannot be replayed piecewise: :func:`deferred` then
returns None for the initialisation and the caller builds it whole, as before.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.runtime.meta import OVERWRITES, adopt, unfilled


class NotReplayable(Exception):
    """The builder did something :class:`Initialisation` cannot replay one tensor at a time."""


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _draws(func) -> bool:
    """Whether ``func`` takes a random generator (it advances the random state)."""
    return any("Generator" in str(a.type) for a in func._schema.arguments)


def _on_cpu(value):
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    key: int  # the storage it makes (a factory) or fills (in place)
    makes: bool


@dataclass
class _Recorder(TorchDispatchMode):
    ops: list[_Op] = field(default_factory=list)
    made: dict[int, tuple] = field(default_factory=dict)  # storage -> (geometry, dtype) it was made with
    derived: set[int] = field(default_factory=set)  # storages computed from other meta tensors
    keep: list = field(default_factory=list)  # the meta tensors seen (their storages must not be reused)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = args[0] if unfilled(func, args) else func(*args, **kwargs)  # (noted to replay, not run on meta)
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if torch.is_tensor(a)]
        metas = [a for a in inputs if a.device.type == "meta"]
        mutable, name = func._schema.is_mutable, func._schema.name.split("::")[-1]
        if mutable and metas:
            target = args[0]
            if torch.is_tensor(target) and target.device.type == "meta" and _key(target) not in self.made \
                    and name in OVERWRITES and len(metas) == 1:  # made without an operation (torch.tensor)
                self.made[_key(target)] = (_geometry(target), target.dtype)
            if not torch.is_tensor(target) or target.device.type != "meta" or len(metas) != 1 \
                    or _key(target) not in self.made or _geometry(target) != self.made[_key(target)][0]:
                raise NotReplayable(f"{func} changes part of a tensor, or one computed from another")
            self.ops.append(_Op(func, args[1:], kwargs, _key(target), False))
            self.keep.append(target)
            return out
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(o) and o.device.type == "meta"]
        if not metas and outs:  # a factory: empty, zeros, ones, full, randn ...
            if len(outs) != 1 or any(a.device.type != "cpu" for a in inputs):
                raise NotReplayable(f"{func} makes a tensor from another device's")
            self.made[_key(outs[0])] = (_geometry(outs[0]), outs[0].dtype)
            self.ops.append(_Op(func, args, kwargs, _key(outs[0]), True))
            self.keep.append(outs[0])
        elif metas:
            if _draws(func):
                raise NotReplayable(f"{func} draws random numbers for a computed tensor")
            for o in outs:  # a view shares its input's storage; anything else is a new, computed one
                if _key(o) not in {_key(a) for a in metas}:
                    self.derived.add(_key(o))
                    self.keep.append(o)
        return out


class Initialisation:
    """How a model built on the meta device gets its values: :meth:`tensors` replays the build."""

    def __init__(self, recorder: _Recorder, names: dict[int, list[str]], start: torch.Tensor,
                 after_build: torch.Tensor):
        self._ops, self._made, self._names = recorder.ops, recorder.made, names
        self._start, self._after_build = start, after_build
        self._first: dict[int, int] = {}  # storage -> index of the op that begins its final values
        self._last: dict[int, int] = {}
        for i, op in enumerate(self._ops):
            if op.makes or op.func._schema.name.split("::")[-1] in OVERWRITES:
                self._first[op.key] = i
            self._last[op.key] = i
        missing = [names[k][0] for k in names if k not in self._first]
        if missing:
            raise NotReplayable(f"{missing[0]} was not made by a factory")

    def tensors(self) -> Iterator[tuple[list[str], torch.Tensor]]:
        """Each tensor of the model, whole, as ``(its names, the tensor)`` -- in the order the build finished
        them, each the moment it is done (the caller keeps its part and drops it). The global random state
        must be the one the meta build left (nothing may draw in between); it ends as a real build's would."""
        if not torch.equal(torch.get_rng_state(), self._after_build):
            raise RuntimeError("the random state changed between the model's meta build and its initialisation: "
                               "initialise before anything else draws random numbers")
        torch.set_rng_state(self._start)
        live: dict[int, torch.Tensor] = {}
        for i, op in enumerate(self._ops):
            final = op.key in self._names and i >= self._first[op.key]
            if not final:
                if _draws(op.func):  # only its random numbers matter: draw them into a scratch tensor
                    self._scratch(op)
                continue
            if op.makes:
                live[op.key] = op.func(*_on_cpu(op.args), **_on_cpu(op.kwargs))
            else:  # the first may be a full overwrite: the tensor's own making was only drawn
                op.func(live[op.key] if op.key in live else live.setdefault(op.key, self._empty(op.key)),
                        *op.args, **op.kwargs)
            if i == self._last[op.key]:
                yield self._names[op.key], live.pop(op.key)

    def fill(self, model: nn.Module) -> nn.Module:
        """Give ``model`` (the meta build) every tensor whole, in place: a real build's model."""
        tensors = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        for names, value in self.tensors():
            adopt(tensors[names[0]], value)  # a tied tensor is one object under each of its names
        return model

    def _scratch(self, op: _Op) -> None:
        if op.makes:
            op.func(*_on_cpu(op.args), **_on_cpu(op.kwargs))
        else:
            op.func(self._empty(op.key), *op.args, **op.kwargs)

    def _empty(self, key: int) -> torch.Tensor:
        (shape, stride, _), dtype = self._made[key]
        return transient(shape, stride, dtype)


MAPPED_FROM = 1 << 20  # bytes: a transient tensor this large gets pages of its own


def transient(shape, stride, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor that lives only while one tensor is made and cut. From 1 MiB up, its memory is
    an anonymous mapping of its own, returned to the system the moment the tensor is dropped: from the heap, a
    run's tuned allocator (:func:`distlab.runtime.device.tune_host_allocator` keeps up to 128 MiB of freed blocks)
    would keep each freed tensor among the pieces the rank keeps, and the resident set would grow by them too."""
    numel = sum((size - 1) * step for size, step in zip(shape, stride)) + 1 if all(shape) else 0
    nbytes = numel * dtype.itemsize
    if nbytes < MAPPED_FROM:
        return torch.empty_strided(shape, stride, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)
    return torch.frombuffer(pages, dtype=dtype, count=numel).as_strided(shape, stride)


def deferred(build: Callable[[], nn.Module]) -> tuple[nn.Module, Initialisation | None]:
    """``build()`` on the meta device and how to give it its values (:class:`Initialisation`); where the
    build cannot be replayed one tensor at a time, the model built for real and None."""
    start = torch.get_rng_state()
    recorder = _Recorder()
    try:
        with recorder, torch.device("meta"):
            model = build()
        init = _initialisation(model, recorder, start)
    except NotReplayable:
        torch.set_rng_state(start)
        return build(), None
    return model, init


def _initialisation(model: nn.Module, recorder: _Recorder, start: torch.Tensor) -> Initialisation:
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    names: dict[int, list[str]] = {}
    for name, t in tensors.items():
        if t.device.type != "meta":
            raise NotReplayable(f"{name} was made on {t.device}")
        key = _key(t)
        if key in recorder.derived or key not in recorder.made or _geometry(t) != recorder.made[key][0]:
            raise NotReplayable(f"{name} is computed, or a part of a larger tensor")
        names.setdefault(key, []).append(name)
    for name, m in model.named_modules():  # a tensor kept as a plain attribute is in no state: never given values
        loose = [k for k, v in vars(m).items() if torch.is_tensor(v) and v.is_meta and not isinstance(v, nn.Parameter)]
        if loose:
            raise NotReplayable(f"{name}.{loose[0]} is a tensor that is neither a parameter nor a buffer")
    return Initialisation(recorder, names, start, torch.get_rng_state())


__all__ = ["Initialisation", "NotReplayable", "deferred"]
