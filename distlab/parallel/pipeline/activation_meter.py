"""Bytes autograd holds for backward, measured through its saved-tensor hooks: what a pipeline
schedule (distlab's or torch's), activation checkpointing or any step keeps alive between its forward
and its backward."""

from __future__ import annotations

import torch

from distlab.parallel.state_bytes import plain, storage_key
from distlab.runtime.eager import eager


class ActivationMeter:
    """Bytes autograd holds for backward, live and at their peak, while the context is open.

    Every tensor saved for backward passes through a pack hook; its storage is counted once
    however many tensors view it, from the first save until the last saved reference is released
    (after its backward, or when its graph is dropped). Parameters are excepted (``params``: they
    are held whatever the schedule). Works for any code run in this thread, so it measures torch's
    pipeline schedules the same way as distlab's.
    """

    def __init__(self, params=()):
        params = list(params)
        self._params = {storage_key(t.untyped_storage()) for t in plain(params)}  # (a quantized weight: its parts)
        self._ids = {id(p) for p in params}  # (... whose parts ZeRO-3 gathers into storage of their own)
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [saved references, bytes]
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)

    @eager  # counted as it runs, never traced into a compiled block's graph
    def _pack(self, t: torch.Tensor):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__") and \
                (id(t) in self._ids or all(storage_key(p.untyped_storage()) in self._params for p in plain([t]))):
            return t  # a tensor subclass made of parameters (a quantized weight saved for its backward)
        storage = t.untyped_storage()
        key = storage_key(storage)
        if key in self._params or not key:
            return t
        ref = self._refs.setdefault(key, [0, storage.nbytes()])
        if ref[0] == 0:
            self.live += ref[1]
            self.peak = max(self.peak, self.live)
        ref[0] += 1
        return _Held(t, self, key)

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]

    _open: list["ActivationMeter"] = []  # the meters open now, innermost last

    @classmethod
    def current(cls) -> "ActivationMeter | None":
        """The innermost meter open now (None where none is)."""
        return cls._open[-1] if cls._open else None

    def hold(self, t: torch.Tensor) -> "_Held | None":
        """Count ``t`` as held for backward by something other than autograd's saved tensors (selective
        checkpointing keeps the outputs it saves in torch's own cache) until the returned handle is dropped;
        None where it is not counted (a parameter, an empty storage)."""
        held = self._pack(t)
        return held if isinstance(held, _Held) else None

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        ActivationMeter._open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        ActivationMeter._open.remove(self)
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor with its meter: releases its count when autograd drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    @staticmethod
    @eager
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def __del__(self):
        meter = getattr(self, "meter", None)  # None: built by torch.compile's tracing, never counted
        if meter is not None:
            meter._release(self.key)
