"""Pipeline parallel: a model's layers in ``P`` stages on ``P`` ranks, micro-batches flowing through.

The model is an ``nn.Sequential`` (the MLP, VGG's feature and classifier stacks flattened, the
GPT: embedding, blocks, head). :func:`partition` cuts it into ``P`` contiguous stages balanced by
parameter count (or at the layer counts given). Stage ``s`` runs on rank ``s`` of the pipeline
group: it receives its input activation from stage ``s - 1`` (the first stage reads the batch),
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

import time
from typing import Callable

import torch
from torch import nn

from distlab.comm.p2p import Peer, wait_all
from distlab.errors import ConfigError
from distlab.runtime import group_rank, group_size

SCHEDULES = ("gpipe", "1f1b")
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_HEADER = 10  # int64s: dtype code, ndim, up to 8 sizes
ACT, GRAD = 0, 1  # message tags


def partition(model: nn.Sequential, stages: int, balance: list[int] | None = None) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the layer range of each stage. ``balance`` gives the number of
    layers per stage; otherwise stages are cut where the running parameter count crosses each
    ``k / stages`` of the total (every stage gets at least one layer)."""
    n = len(model)
    if stages < 1 or stages > n:
        raise ConfigError(f"pipeline: {stages} stages for a model of {n} layers; use between 1 and {n} stages")
    if balance is not None:
        if len(balance) != stages or sum(balance) != n or min(balance) < 1:
            raise ConfigError(f"pipeline: balance {balance} must give {stages} positive layer counts summing to {n}")
        bounds = [0]
        for b in balance:
            bounds.append(bounds[-1] + b)
        return list(zip(bounds[:-1], bounds[1:]))
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
    total = sum(sizes) or n
    sizes = sizes if sum(sizes) else [1] * n
    cuts, running = [0], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        k = len(cuts)  # the cut this layer might close
        layers_left, stages_left = n - (i + 1), stages - k
        if k < stages and (running >= k * total / stages or layers_left == stages_left):
            if i + 1 > cuts[-1]:
                cuts.append(i + 1)
    while len(cuts) < stages:  # too few cuts (tiny models): split the last stage layer by layer
        cuts.append(cuts[-1] + 1)
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:]))


class PipelineStage(nn.Module):
    """This rank's stage of ``model`` on the pipeline ``group`` (stage = group rank).

    ``model`` is the whole model, built and seeded the same way on every rank; the stage keeps its
    layers (under their original indices, so state-dict keys match the unsplit model's) and drops
    the rest. :meth:`train_step` runs one step's forwards and backwards; the optimizer then updates
    this stage's parameters.
    """

    def __init__(self, model: nn.Sequential, group=None, microbatches: int = 1, schedule: str = "1f1b",
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
        self.layers = nn.ModuleDict({str(i): model[i] for i in range(start, end)})
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self._prev = Peer(group, self.stage - 1) if not self.first else None
        self._next = Peer(group, self.stage + 1) if not self.last else None
        self.last_timing: dict = {}
        self.in_flight_peak = 0

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
            loss = loss_fn(out, y) / self.microbatches
            self._losses.append(loss.detach())
            self._saved.append((x, loss))
        else:
            self._saved.append((x, out))
        self._compute += time.perf_counter() - t0
        self.in_flight_peak = max(self.in_flight_peak, len(self._saved))

    def _backward_one(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The oldest stored micro-batch's backward; returns the gradient of its input."""
        x, out = self._saved.pop(0)
        t0 = time.perf_counter()
        torch.autograd.backward(out, None if self.last else grad)
        self._compute += time.perf_counter() - t0
        return None if self.first else x.grad

    # ------------------------------------------------------------------ a step

    def train_step(self, x: torch.Tensor | None, y: torch.Tensor | None, loss_fn: Callable) -> torch.Tensor | None:
        """Forward and backward of one batch as ``M`` micro-batches. ``x`` is read on the first
        stage, ``y`` on the last (others may pass None). Gradients accumulate into this stage's
        parameters. Returns the batch's mean loss on the last stage, None elsewhere."""
        m = self.microbatches
        xs = list(x.chunk(m)) if self.first else [None] * m
        ys = list(y.chunk(m)) if self.last else [None] * m
        if self.first and len(xs) != m:
            raise ConfigError(f"pipeline: a batch of {len(x)} does not split into {m} micro-batches")
        self._saved, self._losses, self._keep = [], [], []
        self._waited = self._compute = 0.0
        self.in_flight_peak = 0
        t0 = time.perf_counter()
        if self.schedule == "gpipe":
            self._gpipe(xs, ys, loss_fn)
        else:
            self._one_f_one_b(xs, ys, loss_fn)
        step = time.perf_counter() - t0
        self.last_timing = {"step_s": step, "wait_s": self._waited, "compute_s": self._compute,
                            "bubble_measured": self._waited / step if step else 0.0,
                            "bubble_ideal": (self.stages - 1) / (m + self.stages - 1),
                            "in_flight_peak": self.in_flight_peak}
        self._keep = []
        return torch.stack(self._losses).sum() if self.last else None

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
