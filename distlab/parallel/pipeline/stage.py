"""One rank's pipeline stage (:class:`PipelineStage`): its layers, the messages to its neighbours and
the step loops of every schedule -- GPipe and 1F1B by hand (:mod:`~distlab.parallel.pipeline.plain`), the others
from their action lists.
What autograd holds for backward while a stage steps is measured by
:class:`~distlab.parallel.pipeline.activation_meter.ActivationMeter`."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager

import torch
from torch import nn

from distlab.comm.p2p import Peer, wait_all
from distlab.errors import ConfigError
from distlab.models.packing import Packed, bind
from distlab.parallel.checkpointing import run_checkpointed
from distlab.parallel.pipeline.activation_meter import ActivationMeter
from distlab.parallel.pipeline.cost import HEADER as _HEADER
from distlab.parallel.pipeline.actions import SCHEDULES, check_virtual, ideal_bubble, schedule_actions
from distlab.parallel.pipeline import plain
from distlab.parallel.pipeline.partition import partition, sequential_layers
from distlab.parallel.pipeline.weight_pass import capture, weight_backward
from distlab.runtime import group_rank, group_size, timeline
from distlab.runtime.trace_file import SCHEDULE

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
ACT, GRAD = 0, 1  # message tags


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

    by_actions = False  # True: GPipe and 1F1B from their action lists too (the executor held to the plain loops)

    def __init__(self, model: nn.Module, group=None, microbatches: int = 1, schedule: str = "1f1b",
                 balance: list[int] | None = None, virtual: int = 1, checkpoint: list[list[str]] | None = None,
                 checkpoint_policy: str = "block"):
        super().__init__()
        self.checkpoint_policy = checkpoint_policy  # what a checkpointed run keeps (checkpointing.POLICIES)
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown `pp_schedule` {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if microbatches < 1:
            raise ConfigError(f"`microbatches` must be at least 1, not {microbatches}")
        self.group, self.schedule, self.microbatches, self.virtual = group, schedule, microbatches, virtual
        self.stages, self.stage = group_size(group), group_rank(group)
        check_virtual(self.stages, virtual, microbatches, schedule)
        self.ranges = partition(model, self.stages * virtual, balance)
        named = sequential_layers(model)
        # chunk c of this rank is virtual stage c x P + rank (the whole model's layers start..end-1)
        self.chunks = [[str(i) for i in range(*self.ranges[c * self.stages + self.stage])] for c in range(virtual)]
        mine = [int(i) for chunk in self.chunks for i in chunk]
        self.names = {str(i): named[i][0] for i in mine}
        self.layer_names = [name for name, _ in named]
        self.layer_parameters = [sum(p.numel() for p in layer.parameters()) for _, layer in named]
        self.layers = nn.ModuleDict({str(i): named[i][1] for i in mine})
        # activation checkpointing: each run of a chunk's layers that belong to one block recomputes in backward
        block_of = {name: b for b, names in enumerate(checkpoint or []) for name in names}
        self.segments = [self._segments(chunk, block_of) for chunk in self.chunks]
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        wraps = virtual > 1  # a micro-batch goes round the ranks V times: the last rank feeds the first
        self._prev = Peer(group, (self.stage - 1) % self.stages) if not self.first or wraps else None
        self._next = Peer(group, (self.stage + 1) % self.stages) if not self.last or wraps else None
        self.last_timing: dict = {}
        self._precision = None  # train_step's
        self.in_flight_peak = self.activation_peak_bytes = 0
        self._forwards = 0  # this step's forwards so far (a span's micro-batch number)
        self._waited = self._compute = 0.0

    def describe(self) -> list[dict]:
        """Every stage (virtual stage, when interleaved: ``rank`` holds it): its layer range, first
        and last layer names, and parameters (on this rank's tensor-parallel shard, if any)."""
        return [{"stage": s, "layers": [a, b], "first": self.layer_names[a], "last": self.layer_names[b - 1],
                 "parameters": sum(self.layer_parameters[a:b]), **({"rank": s % self.stages} if self.virtual > 1 else {})}
                for s, (a, b) in enumerate(self.ranges)]

    def model_key(self, key: str) -> str:
        """A key of this stage's ``state_dict`` or module name (``layers.3.weight``) as the whole
        model's (``net.3.weight``)."""
        _, index, *rest = key.split(".", 2)
        return ".".join([self.names[index], *rest])

    def chunk_of(self, key: str) -> int:
        """Which of this rank's chunks holds the layer of a stage key (``layers.3.weight``)."""
        index = key.split(".", 2)[1]
        return next(c for c, chunk in enumerate(self.chunks) if index in chunk)

    # ------------------------------------------------------------------ pieces

    def _segments(self, chunk: list[str], block_of: dict[str, int]) -> list[tuple[list[str], bool]]:
        """The chunk's layer keys as consecutive runs: ``(keys, checkpointed)``, a checkpointed run being
        the part of one block this chunk holds (a block cut by a stage boundary recomputes per part).
        Keys, not modules: SyncBN and others replace layers in ``self.layers`` after the cut."""
        runs: list[tuple[list[str], int | None]] = []
        for key in chunk:
            b = block_of.get(self.names[key])
            if runs and b is not None and runs[-1][1] == b:
                runs[-1][0].append(key)
            else:
                runs.append(([key], b))
        return [(keys, b is not None) for keys, b in runs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in range(self.virtual):
            x = self._run_chunk(c, x)
        return x

    def _run_chunk(self, c: int, x: torch.Tensor) -> torch.Tensor:
        for keys, checkpointed in self.segments[c]:
            modules = [self.layers[key] for key in keys]
            if checkpointed:
                x = run_checkpointed(modules, x, self.checkpoint_policy)
            else:
                for m in modules:
                    x = m(x)
        return x

    def _loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss, kept for the step's total; what backward starts
        from (under fp16 loss scaling: times the scale)."""
        loss = loss / self.microbatches
        self._losses.append(loss.detach())
        scaler = self._precision.scaler if self._precision is not None else None
        return scaler.scale(loss) if scaler is not None else loss

    def _autocast(self) -> ContextManager:
        return self._precision.autocast() if self._precision is not None else contextlib.nullcontext()

    def _send_act(self, t: torch.Tensor, tag: int = ACT) -> list:
        shape = list(t.shape)
        if len(shape) > _HEADER - 2:
            raise ConfigError(f"pipeline: activations of {len(shape)} dimensions are not supported (at most 8)")
        header = torch.tensor([_DTYPES.index(t.dtype), len(shape), *shape, *[0] * (_HEADER - 2 - len(shape))],
                              dtype=torch.int64)
        t = t.detach().contiguous()
        self._keep += [header, t]  # alive until the send completes
        return [self._next.isend(header, tag), self._next.isend(t, tag)]

    def _recv_act(self, tag: int = ACT) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._wait(self._prev.irecv(header, tag), what="wait for an activation")
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        t = torch.empty([int(s) for s in header[2:2 + ndim]], dtype=dtype)
        self._wait(self._prev.irecv(t, tag), what="wait for an activation")
        return t

    def _wait(self, *works, what: str = "wait") -> None:
        t0 = time.perf_counter()
        with timeline.span(what, "pipeline"):
            wait_all(works)
        self._waited += time.perf_counter() - t0

    def _forward_one(self, x: torch.Tensor, y: torch.Tensor | None, loss_fn: Callable) -> None:
        """One micro-batch forward; keeps what its backward needs."""
        if not self.first:
            x = x.requires_grad_()
        bind(self, self._fields[self._forwards])  # a packed micro-batch's structure, for its attentions
        t0 = time.perf_counter()
        with timeline.span(f"stage {self.stage} F mb {self._forwards}"), self._autocast():
            out = self(x)
            if self.last:
                out = self._loss(loss_fn(out, y))
        self._forwards += 1
        self._saved.append((x, out))
        self._compute += time.perf_counter() - t0
        self.in_flight_peak = max(self.in_flight_peak, len(self._saved))

    def _backward_one(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The oldest stored micro-batch's backward; returns the gradient of its input. All but the
        step's last backward run under ``no_sync`` (data parallel communicates after the last)."""
        x, out = self._saved.pop(0)
        bind(self, self._fields[self.microbatches - self._backwards_left])  # what a recomputed block reads
        self._backwards_left -= 1
        t0 = time.perf_counter()
        with timeline.span(f"stage {self.stage} B mb {self.microbatches - self._backwards_left - 1}"), \
                self._no_sync() if self._backwards_left else contextlib.nullcontext():
            if out.requires_grad:  # (a first stage of frozen layers only -- LoRA's embedding -- has no backward)
                torch.autograd.backward(out, None if self.last else grad)
        self._compute += time.perf_counter() - t0
        return None if self.first else x.grad

    # ------------------------------------------------------------------ a step

    def train_step(self, x: torch.Tensor | None, y: torch.Tensor | None, loss_fn: Callable,
                   no_sync: Callable[[], ContextManager] | None = None,
                   batch_size: int | None = None, precision=None, fields: Packed | None = None) -> torch.Tensor | None:
        """Forward and backward of one batch as ``M`` equal micro-batches. ``x`` is read on the first
        stage, ``y`` on the last (others may pass None). Gradients accumulate into this stage's
        parameters. Returns the batch's mean loss on the last stage, None elsewhere.

        ``precision`` (a :class:`~distlab.parallel.precision.Precision`): forwards and the loss run
        under its autocast; under fp16 backward starts from the loss times its scaler's scale (the
        gradients crossing stages are scaled too; the engine unscales after the step's reduction).

        ``no_sync``: a context in which backward communicates nothing (a data-parallel wrapper's);
        every backward but the step's last runs in it, so gradients are reduced once, overlapped
        with the last micro-batch's backward where the method can.

        A batch that ``M`` does not divide is refused before any message: on the stages that hold
        ``x`` or ``y``, and on every stage when ``batch_size`` is given (a middle stage cannot see
        the batch; without it, it would wait for a first stage that already refused).

        ``fields``: the batch's structure (a packed batch's :class:`~distlab.models.packing.Packed`), on every
        stage: each micro-batch's rows are bound to this stage's attentions before its forward and its backward."""
        m = self.microbatches
        for have in (batch_size, len(x) if self.first and x is not None else None,
                     len(y) if self.last and y is not None else None):
            check_microbatches(have, m)
        xs = list(x.chunk(m)) if self.first else [None] * m
        ys = list(y.chunk(m)) if self.last else [None] * m
        self._fields = fields.chunk(m) if fields is not None else [None] * m
        self._saved, self._losses, self._keep = [], [], []
        self._no_sync, self._backwards_left, self._forwards = no_sync or contextlib.nullcontext, m, 0
        self._precision = precision
        self._waited = self._compute = 0.0
        self.in_flight_peak = 0
        t0 = time.perf_counter()
        with ActivationMeter(self.parameters()) as meter, timeline.span(SCHEDULE, "pipeline"):
            if self.schedule == "gpipe" and not self.by_actions:
                plain.gpipe(self, xs, ys, loss_fn)
            elif self.schedule == "1f1b" and self.virtual == 1 and not self.by_actions:
                plain.one_f_one_b(self, xs, ys, loss_fn)
            else:
                self._actions(xs, ys, loss_fn)
        self.activation_peak_bytes = meter.peak
        bind(self, None)
        step = time.perf_counter() - t0
        self.last_timing = {"step_s": step, "wait_s": self._waited, "compute_s": self._compute,
                            "bubble_measured": self._waited / step if step else 0.0,
                            "bubble_ideal": ideal_bubble(self.stages, m, self.schedule, self.virtual),
                            "in_flight_peak": self.in_flight_peak, "activation_peak_bytes": self.activation_peak_bytes}
        self._keep = []
        return torch.stack(self._losses).sum() if self.last else None

    @torch.no_grad()
    def infer(self, x: torch.Tensor | None, fields: Packed | None = None) -> torch.Tensor | None:
        """One batch forward through the whole pipeline without gradients: the output on the last
        stage, None elsewhere (``x`` is read on the first stage; ``fields``, its structure, on every one).
        Every stage calls it once per batch."""
        try:
            bind(self, fields)
            return self._infer(x)
        finally:
            bind(self, None)

    def _infer(self, x: torch.Tensor | None) -> torch.Tensor | None:
        self._keep = []
        if self.virtual > 1:
            last_k = self.stages * self.virtual - 1
            for c in range(self.virtual):
                k = c * self.stages + self.stage
                out = self._run_chunk(c, x if k == 0 else self._recv_act(_act_tag(k)))
                if k != last_k:
                    wait_all(self._send_act(out, _act_tag(k + 1)))
            self._keep = []
            return out if self.last else None
        out = self(x if self.first else self._recv_act())
        if not self.last:
            wait_all(self._send_act(out))
        self._keep = []
        return out if self.last else None

    def _input(self, xs, i):
        return xs[i] if self.first else self._recv_act()

    def _actions(self, xs, ys, loss_fn) -> None:
        """Run this rank's list of :func:`schedule_actions` (interleaved 1F1B, zero bubble)."""
        P, M, split = self.stages, self.microbatches, self.schedule == "zb"
        last_k = P * self.virtual - 1
        acts = schedule_actions(self.schedule, P, self.virtual, M)[self.stage]
        accumulating = "W" if split else "B"
        final = {c: i for i, (kind, c, *_) in enumerate(acts) if kind == accumulating}  # a chunk's last: syncs
        saved: dict[tuple[int, int], list] = {}
        sends, held = [], 0
        owners = [[(mod, own) for key in chunk for mod in self.layers[key].modules()  # modules with weights
                   if (own := [p for p in mod.parameters(recurse=False) if p.requires_grad])]
                  for chunk in self.chunks] if split else []
        for i, (kind, c, m, _, _) in enumerate(acts):
            k = c * P + self.stage
            t0 = time.perf_counter()
            bind(self, self._fields[m])  # the micro-batch's structure: its forward's, and a recomputation's
            if kind == "F":
                x = xs[m] if k == 0 else self._recv_act(_act_tag(k))
                t0 = time.perf_counter()
                if k:
                    x.requires_grad_()
                # zero bubble: where each weight's gradient is taken from later (the nearest product: weight_pass)
                with timeline.span(f"stage {self.stage} chunk {c} F mb {m}"), self._autocast():
                    with capture(owners[c]) if split else contextlib.nullcontext([]) as captured:
                        out = self._run_chunk(c, x)
                    if k == last_k:  # (outside the capture: the loss reads no weight)
                        out = self._loss(loss_fn(out, ys[m]))
                self._compute += time.perf_counter() - t0
                if k != last_k:
                    sends += self._send_act(out, _act_tag(k + 1))
                saved[(c, m)] = [x, out, captured]
                held += 1
                self.in_flight_peak = max(self.in_flight_peak, held)
            elif kind == "B":
                x, out, captured = saved[(c, m)]
                grad = None
                if k != last_k:
                    grad = torch.empty_like(out)
                    self._wait(self._next.irecv(grad, _grad_tag(k + 1)), what="wait for a gradient")
                t0 = time.perf_counter()
                if split:  # the input's gradient only; keep the graph and the kept tensors' gradients for W
                    outs = [o for o, _ in captured]
                    with timeline.span(f"stage {self.stage} chunk {c} B mb {m}"):
                        got = torch.autograd.grad(out, ([x] if k else []) + outs, grad, retain_graph=True,
                                                  allow_unused=True) if out.requires_grad else [None] * (bool(k) + len(outs))
                    g_in = got[0] if k else None
                    saved[(c, m)][2] = [(o, own, g) for (o, own), g in zip(captured, got[1 if k else 0:])
                                        if g is not None]
                else:
                    with timeline.span(f"stage {self.stage} chunk {c} B mb {m}"), \
                            self._no_sync() if i != final[c] else contextlib.nullcontext():
                        if out.requires_grad:  # (a first chunk of frozen layers only has no backward)
                            torch.autograd.backward(out, grad)
                    g_in = x.grad if k else None
                    del saved[(c, m)]
                    held -= 1
                self._compute += time.perf_counter() - t0
                if k:
                    sends.append(self._prev.isend(g_in.contiguous(), _grad_tag(k)))
            else:  # W: the weights' gradients, from the outputs' gradients B kept
                _, _, pairs = saved.pop((c, m))
                held -= 1
                with timeline.span(f"stage {self.stage} chunk {c} W mb {m}"), \
                        self._no_sync() if i != final[c] else contextlib.nullcontext():
                    weight_backward(pairs)  # from each kept tensor to its own weights only
                self._compute += time.perf_counter() - t0
        self._wait(*sends, what="wait for sends")


def _act_tag(k: int) -> int:
    """Tag of the activations entering virtual stage ``k`` (interleaved and zero-bubble schedules)."""
    return 2 + 2 * k


def _grad_tag(k: int) -> int:
    """Tag of the gradients of virtual stage ``k``'s input, sent back to stage ``k - 1``."""
    return 3 + 2 * k
