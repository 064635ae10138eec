"""Pipeline parallel: a model's layers in ``P`` stages on ``P`` ranks, micro-batches flowing through.

The model is a sequence of layers: an ``nn.Sequential`` (the GPT: embedding, blocks, head), or a
model that lists its layers in order with ``pipeline_layers()`` (the MLP; VGG's features, pool and
classifier; ResNet's stem, blocks and head) -- :func:`sequential_layers`. :func:`partition` cuts
it into ``P`` contiguous stages balanced by parameter count (or at the layer counts given).
Stage ``s`` runs on rank ``s`` of the pipeline group: it receives its input activation from stage ``s - 1`` (the first stage reads the batch),
runs its layers, and sends the output to stage ``s + 1``; the last stage computes the loss. In the
backward pass gradients travel the other way. A step splits the batch into ``M`` micro-batches,
each loss divided by ``M``, so the accumulated gradients are those of the whole batch: the step
equals one step of the unsplit model.

Two schedules (the order in which each stage runs its ``M`` forwards and ``M`` backwards):

* **GPipe** (Huang et al. 2019): all forwards, then all backwards. Every stage holds the
  activations of all ``M`` micro-batches at the turn.
* **1F1B** (PipeDream-flush, Narayanan et al. 2021): stage ``s`` runs ``P - s - 1`` forwards to
  fill the pipeline, then alternates one forward and one backward, then drains. It holds at most
  ``P - s`` micro-batches' activations, whatever ``M``; the idle time is the same as GPipe's.

Either way a stage idles while the pipeline fills and drains: the *bubble*, ``(P - 1) / (M + P - 1)``
of the step with equal stages. :attr:`PipelineStage.last_timing` measures it per step: time spent
waiting for a neighbour's message over the step's time.

Messages are point-to-point (:mod:`distlab.comm.p2p`, so the bytes are counted): an activation
goes with a small header giving its shape (stage outputs differ in shape: a CNN's feature maps, a
transformer's ``(B, T, C)``); a gradient has its activation's shape, which the sender's neighbour
knows. A send and the receive a stage needs next are posted together, so neighbours never wait on
each other's sends.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager

import torch
from torch import nn

from distlab.comm.p2p import Peer, wait_all
from distlab.errors import ConfigError
from distlab.runtime import group_rank, group_size

SCHEDULES = ("gpipe", "1f1b")
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_HEADER = 10  # int64s: dtype code, ndim, up to 8 sizes
ACT, GRAD = 0, 1  # message tags


def ideal_bubble(stages: int, microbatches: int) -> float:
    """The share of a step each stage idles while the pipeline fills and drains, with equal stages:
    ``(P - 1) / (M + P - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def sequential_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``[(name, layer), ...]``: the model as layers applied one after another, each under its
    name in ``model`` (so a stage's state-dict keys can be written as the whole model's)."""
    if isinstance(model, nn.Sequential):
        return [(str(i), layer) for i, layer in enumerate(model)]
    listed = getattr(model, "pipeline_layers", None)
    if listed is None:
        raise ConfigError(f"a pipeline cuts a model into consecutive layers: {type(model).__name__} is not an "
                          f"nn.Sequential and has no pipeline_layers() listing its layers in order")
    return list(listed())


def partition(model: nn.Module, stages: int, balance: list[int] | None = None) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the layer range of each stage (indices into :func:`sequential_layers`).

    ``balance`` gives the number of layers per stage. Otherwise stage ``k`` starts at the layer
    with parameters where the parameters before it come nearest ``k / stages`` of the total; layers
    without parameters (activations, pooling, flatten) stay with the layer before them, so every
    stage has parameters to train whenever the model has at least ``stages`` layers with some.
    """
    return cut([sum(p.numel() for p in layer.parameters()) for _, layer in sequential_layers(model)], stages, balance)


def cut(sizes: list[int], stages: int, balance: list[int] | None = None) -> list[tuple[int, int]]:
    """:func:`partition` on the layers' parameter counts alone (what ``distlab plan`` cuts by)."""
    n = len(sizes)
    if stages < 1 or stages > n:
        raise ConfigError(f"`pp` {stages}: the model has {n} layers to cut into stages; use between 1 and {n} "
                          f"stages")
    if balance is not None:
        if len(balance) != stages or sum(balance) != n or min(balance) < 1:
            raise ConfigError(f"pipeline: balance {list(balance)} must give {stages} positive layer counts summing "
                              f"to {n}")
        bounds = [0]
        for b in balance:
            bounds.append(bounds[-1] + b)
        ranges = list(zip(bounds[:-1], bounds[1:]))
        empty = [s for s, (a, b) in enumerate(ranges) if not sum(sizes[a:b])]
        if empty and sum(sizes):
            raise ConfigError(f"pipeline: balance {list(balance)} leaves stage {empty[0]} without parameters; give "
                              f"every stage a layer with parameters")
        return ranges
    if not sum(sizes):  # nothing to balance: layers count equally
        sizes = [1] * n
    heavy = [i for i, size in enumerate(sizes) if size]  # the layers a stage may start at (and the first)
    if stages > len(heavy):
        raise ConfigError(f"`pp` {stages}: the model has {len(heavy)} layers with parameters, and a stage without "
                          f"any would have nothing to train; use at most {len(heavy)} stages")
    before = [0]  # parameters before each heavy layer
    for i in heavy[:-1]:
        before.append(before[-1] + sizes[i])
    total, starts = sum(sizes), [0]
    for k in range(1, stages):
        low, high = starts[-1] + 1, len(heavy) - (stages - k)  # leave a heavy layer for every later stage
        starts.append(min(range(low, high + 1), key=lambda j: abs(before[j] - k * total / stages)))
    cuts = [0] + [heavy[j] for j in starts[1:]] + [n]
    return list(zip(cuts[:-1], cuts[1:]))


class ActivationMeter:
    """Bytes autograd holds for backward, live and at their peak, while the context is open.

    Every tensor saved for backward passes through a pack hook; its storage is counted once
    however many tensors view it, from the first save until the last saved reference is released
    (after its backward, or when its graph is dropped). Parameters are excepted (``params``: they
    are held whatever the schedule). Works for any code run in this thread, so it measures torch's
    pipeline schedules the same way as distlab's.
    """

    def __init__(self, params=()):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [saved references, bytes]
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
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

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor with its meter: releases its count when autograd drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def __del__(self):
        self.meter._release(self.key)


def check_microbatches(batch: int | None, microbatches: int, what: str = "pipeline micro-batches") -> None:
    """Refuse a batch that does not split into equal micro-batches (unequal ones would weigh each
    sample differently: 10 into 4 is 3, 3, 3, 1, each averaged and then divided by 4)."""
    if batch is not None and batch % microbatches:
        raise ConfigError(f"a batch of {batch} samples does not split into {microbatches} equal {what}: give a "
                          f"batch that {microbatches} divides")


class PipelineStage(nn.Module):
    """This rank's stage of ``model`` on the pipeline ``group`` (stage = group rank).

    ``model`` is the whole model, built and seeded the same way on every rank; the stage keeps its
    layers (in ``layers`` under their index in :func:`sequential_layers`; :meth:`model_key` turns a
    stage key into the whole model's) and drops the rest. :meth:`train_step` runs one step's
    forwards and backwards; the optimizer then updates this stage's parameters. :meth:`infer`
    passes one batch through the pipeline without gradients (evaluation).
    """

    def __init__(self, model: nn.Module, group=None, microbatches: int = 1, schedule: str = "1f1b",
                 balance: list[int] | None = None):
        super().__init__()
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown `pp_schedule` {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if microbatches < 1:
            raise ConfigError(f"`microbatches` must be at least 1, not {microbatches}")
        self.group, self.schedule, self.microbatches = group, schedule, microbatches
        self.stages, self.stage = group_size(group), group_rank(group)
        self.ranges = partition(model, self.stages, balance)
        start, end = self.ranges[self.stage]
        named = sequential_layers(model)
        self.names = {str(i): named[i][0] for i in range(start, end)}
        self.layer_names = [name for name, _ in named]
        self.layer_parameters = [sum(p.numel() for p in layer.parameters()) for _, layer in named]
        self.layers = nn.ModuleDict({str(i): named[i][1] for i in range(start, end)})
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self._prev = Peer(group, self.stage - 1) if not self.first else None
        self._next = Peer(group, self.stage + 1) if not self.last else None
        self.last_timing: dict = {}
        self.in_flight_peak = self.activation_peak_bytes = 0
        self._waited = self._compute = 0.0

    def describe(self) -> list[dict]:
        """Every stage: its layer range, first and last layer names, and parameters (on this rank's
        tensor-parallel shard, if any)."""
        return [{"stage": s, "layers": [a, b], "first": self.layer_names[a], "last": self.layer_names[b - 1],
                 "parameters": sum(self.layer_parameters[a:b])} for s, (a, b) in enumerate(self.ranges)]

    def model_key(self, key: str) -> str:
        """A key of this stage's ``state_dict`` or module name (``layers.3.weight``) as the whole
        model's (``net.3.weight``)."""
        _, index, *rest = key.split(".", 2)
        return ".".join([self.names[index], *rest])

    # ------------------------------------------------------------------ pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x

    def _send_act(self, t: torch.Tensor) -> list:
        shape = list(t.shape)
        if len(shape) > _HEADER - 2:
            raise ConfigError(f"pipeline: activations of {len(shape)} dimensions are not supported (at most 8)")
        header = torch.tensor([_DTYPES.index(t.dtype), len(shape), *shape, *[0] * (_HEADER - 2 - len(shape))],
                              dtype=torch.int64)
        t = t.detach().contiguous()
        self._keep += [header, t]  # alive until the send completes
        return [self._next.isend(header, ACT), self._next.isend(t, ACT)]

    def _recv_act(self) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._wait(self._prev.irecv(header, ACT))
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        t = torch.empty([int(s) for s in header[2:2 + ndim]], dtype=dtype)
        self._wait(self._prev.irecv(t, ACT))
        return t

    def _wait(self, *works) -> None:
        t0 = time.perf_counter()
        wait_all(works)
        self._waited += time.perf_counter() - t0

    def _forward_one(self, x: torch.Tensor, y: torch.Tensor | None, loss_fn: Callable) -> None:
        """One micro-batch forward; keeps what its backward needs."""
        if not self.first:
            x = x.requires_grad_()
        t0 = time.perf_counter()
        out = self(x)
        if self.last:
            out = loss_fn(out, y) / self.microbatches
            self._losses.append(out.detach())
        self._saved.append((x, out))
        self._compute += time.perf_counter() - t0
        self.in_flight_peak = max(self.in_flight_peak, len(self._saved))

    def _backward_one(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The oldest stored micro-batch's backward; returns the gradient of its input. All but the
        step's last backward run under ``no_sync`` (data parallel communicates after the last)."""
        x, out = self._saved.pop(0)
        self._backwards_left -= 1
        t0 = time.perf_counter()
        with self._no_sync() if self._backwards_left else contextlib.nullcontext():
            torch.autograd.backward(out, None if self.last else grad)
        self._compute += time.perf_counter() - t0
        return None if self.first else x.grad

    # ------------------------------------------------------------------ a step

    def train_step(self, x: torch.Tensor | None, y: torch.Tensor | None, loss_fn: Callable,
                   no_sync: Callable[[], ContextManager] | None = None,
                   batch_size: int | None = None) -> torch.Tensor | None:
        """Forward and backward of one batch as ``M`` equal micro-batches. ``x`` is read on the first
        stage, ``y`` on the last (others may pass None). Gradients accumulate into this stage's
        parameters. Returns the batch's mean loss on the last stage, None elsewhere.

        ``no_sync``: a context in which backward communicates nothing (a data-parallel wrapper's);
        every backward but the step's last runs in it, so gradients are reduced once, overlapped
        with the last micro-batch's backward where the method can.

        A batch that ``M`` does not divide is refused before any message: on the stages that hold
        ``x`` or ``y``, and on every stage when ``batch_size`` is given (a middle stage cannot see
        the batch; without it, it would wait for a first stage that already refused)."""
        m = self.microbatches
        for have in (batch_size, len(x) if self.first and x is not None else None,
                     len(y) if self.last and y is not None else None):
            check_microbatches(have, m)
        xs = list(x.chunk(m)) if self.first else [None] * m
        ys = list(y.chunk(m)) if self.last else [None] * m
        self._saved, self._losses, self._keep = [], [], []
        self._no_sync, self._backwards_left = no_sync or contextlib.nullcontext, m
        self._waited = self._compute = 0.0
        self.in_flight_peak = 0
        t0 = time.perf_counter()
        with ActivationMeter(self.parameters()) as meter:
            if self.schedule == "gpipe":
                self._gpipe(xs, ys, loss_fn)
            else:
                self._one_f_one_b(xs, ys, loss_fn)
        self.activation_peak_bytes = meter.peak
        step = time.perf_counter() - t0
        self.last_timing = {"step_s": step, "wait_s": self._waited, "compute_s": self._compute,
                            "bubble_measured": self._waited / step if step else 0.0,
                            "bubble_ideal": ideal_bubble(self.stages, m),
                            "in_flight_peak": self.in_flight_peak, "activation_peak_bytes": self.activation_peak_bytes}
        self._keep = []
        return torch.stack(self._losses).sum() if self.last else None

    @torch.no_grad()
    def infer(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """One batch forward through the whole pipeline without gradients: the output on the last
        stage, None elsewhere (``x`` is read on the first stage). Every stage calls it once per batch."""
        self._keep = []
        out = self(x if self.first else self._recv_act())
        if not self.last:
            wait_all(self._send_act(out))
        self._keep = []
        return out if self.last else None

    def _input(self, xs, i):
        return xs[i] if self.first else self._recv_act()

    def _gpipe(self, xs, ys, loss_fn) -> None:
        sends = []
        for i in range(self.microbatches):
            self._forward_one(self._input(xs, i), ys[i], loss_fn)
            if not self.last:
                sends += self._send_act(self._saved[-1][1])
        self._wait(*sends)
        sends = []
        for _ in range(self.microbatches):
            grad = None
            if not self.last:
                x, out = self._saved[0]
                grad = torch.empty_like(out)
                self._wait(self._next.irecv(grad, GRAD))
            g_in = self._backward_one(grad)
            if not self.first:
                sends.append(self._prev.isend(g_in.contiguous(), GRAD))
        self._wait(*sends)

    def _one_f_one_b(self, xs, ys, loss_fn) -> None:
        m = self.microbatches
        warm = min(self.stages - self.stage - 1, m)
        sends = []
        for i in range(warm):
            self._forward_one(self._input(xs, i), ys[i], loss_fn)
            if not self.last:
                sends += self._send_act(self._saved[-1][1])
        for i in range(warm, m):  # steady state: one forward, one backward
            self._forward_one(self._input(xs, i), ys[i], loss_fn)
            grad = None
            if not self.last:
                sends += self._send_act(self._saved[-1][1])
                grad = torch.empty_like(self._saved[0][1])
                self._wait(self._next.irecv(grad, GRAD))
            g_in = self._backward_one(grad)
            if not self.first:
                sends.append(self._prev.isend(g_in.contiguous(), GRAD))
        for _ in range(warm):  # drain
            grad = torch.empty_like(self._saved[0][1])
            self._wait(self._next.irecv(grad, GRAD))
            g_in = self._backward_one(grad)
            if not self.first:
                sends.append(self._prev.isend(g_in.contiguous(), GRAD))
        self._wait(*sends)
