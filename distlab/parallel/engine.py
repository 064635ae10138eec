"""The :class:`Engine`: a model spread over ranks, the one interface a training loop needs.

Make one with :func:`~distlab.parallel.parallelize` (the composition root, which chooses every part
from a :class:`~distlab.parallel.Strategy`). Whatever the strategy: build the optimizer over
:meth:`Engine.parameters`, then per step :meth:`Engine.forward_backward` (its micro-batches,
communication only after the last), :meth:`Engine.step` (the optimizer step and what follows it).
For state: :meth:`Engine.full_state_dict` (the single-process model, gathered),
:meth:`Engine.sharded_state_dict` / :meth:`Engine.load_sharded_state_dict` (this rank's part,
for snapshots), :meth:`Engine.gathered` (full parameters in place, e.g. for evaluation); where each
piece sits in the whole model: :mod:`~distlab.parallel.placement`. For cost: :meth:`Engine.observe` /
:attr:`Engine.peak_bytes` (model-state bytes) and :meth:`Engine.uncounted_bytes_per_step` (what
:mod:`distlab.comm` cannot count).

The Engine holds a :class:`~distlab.parallel.protocols.GradSync` (data parallel or ZeRO), a
:class:`~distlab.parallel.protocols.StepSchedule` (accumulation or a pipeline), the
:class:`~distlab.parallel.protocols.ModelSharding` components in the order they act (context,
expert and tensor parallel, and any registered: :mod:`~distlab.parallel.components`), one
:class:`~distlab.parallel.protocols.LossHead` and one :class:`~distlab.parallel.precision.Precision`,
and only calls what those promise: nothing here asks which one it holds, nor whether one is there.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch
from torch import nn

from distlab.models.packing import Packed, cut
from distlab.parallel.clipping import clip_by_global_norm_, norm_weights
from distlab.parallel.loss_head import TaskHead, per_kept_target
from distlab.parallel.mesh import Mesh
from distlab.parallel.placement import full_parameters, full_state_dict, placement_of
from distlab.parallel.precision import Precision
from distlab.parallel.priming import prime
from distlab.parallel.protocols import GradSync, LossHead, ModelSharding, StepSchedule
from distlab.parallel.strategy import Strategy
from distlab.parallel import verdict
from distlab.runtime import timeline


class Engine:
    """A model spread over the mesh by a strategy (make one with :func:`parallelize`): one
    :class:`~distlab.parallel.protocols.GradSync`, one :class:`~distlab.parallel.protocols.StepSchedule`,
    the :class:`~distlab.parallel.protocols.ModelSharding` components in the order they act, one
    :class:`~distlab.parallel.protocols.LossHead` and one :class:`~distlab.parallel.precision.Precision`,
    whatever they are."""

    def __init__(self, grad_sync: GradSync, schedule: StepSchedule, strategy: Strategy, mesh: Mesh,
                 precision: Precision, components: tuple[ModelSharding, ...] = (), head: LossHead = TaskHead()):
        self.grad_sync, self.schedule, self.strategy, self.mesh = grad_sync, schedule, strategy, mesh
        self.precision = precision  # autocast, and fp16's loss scaling (a no-op for fp32 and bf16)
        self.components = tuple(components)  # context parallel's token layout, expert parallel's shards
        self.head = head  # scores the output: the task's loss, or the vocabulary-parallel one
        # what a step does about non-finite gradients: read on the host (or fp16's scaled skip) until
        # attach() chooses for the optimizer (verdict.choose)
        self.verdict = verdict.choose(precision, None, False, self._find, self.non_finite_message)
        self.sync_seconds = 0.0  # of the last step: gradient sync after backward + after_step
        self._sharded = grad_sync.sharded or mesh.splits_model  # ranks hold different model states

    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean",
             label_smoothing: float = 0.0) -> torch.Tensor:
        """The task's loss of this model's output: cross-entropy per sample or per token, computed
        across the vocabulary shards when tensor parallel split the LM head (no full logits);
        ``label_smoothing`` as ``F.cross_entropy``'s."""
        return self.head.loss(out, y, reduction, label_smoothing)

    def correct(self, out: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
        """(right predictions, predictions) of this model's output, as :meth:`loss` scores it."""
        return self.head.correct(out, y)

    @property
    def lockstep(self) -> bool:
        """Whether every data-parallel rank must run every forward (a component exchanges data between
        them: expert parallel's tokens), so evaluation pads the shorter shards with empty batches."""
        return any(c.lockstep for c in self.components)

    @property
    def module(self) -> nn.Module:
        """The plain model (tensor-parallel layers in place of the sharded ones)."""
        return self.grad_sync.module

    @property
    def sharded(self) -> bool:
        """Whether ranks hold different model states (ZeRO, tensor-parallel shards, pipeline stages,
        expert shards)."""
        return self._sharded

    def __call__(self, *args, **kwargs):
        return self.grad_sync(*args, **kwargs)

    def shard(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of each batch tensor, as every component cuts it in turn (context parallel:
        its chunks of every sequence, inputs and targets alike); the tensors themselves where none
        does. Evaluation cuts its batches with it before :meth:`infer` and scores the output against
        the cut targets."""
        for component in self.components:
            tensors = component.prepare_batch(*tensors)
        return tensors

    def shard_fields(self, fields: Packed | None) -> Packed | None:
        """This rank's part of a batch's structure (:mod:`distlab.models.packing`): the positions cut as
        :meth:`shard` cuts their tokens, the record numbers whole (the keys a query may read)."""
        return cut(fields, self.shard)

    @torch.no_grad()
    def infer(self, x: torch.Tensor, fields: Packed | None = None) -> torch.Tensor | None:
        """The model's output for one batch (cut by :meth:`shard`, its structure by :meth:`shard_fields`),
        without gradients, where it is known (a pipeline's last stage; every rank elsewhere), None on the
        other stages. Every rank calls it once per batch."""
        return self.schedule.infer(self, x, fields)

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates on this rank (ZeRO: this rank's flat shards)."""
        return self.grad_sync.optimizer_parameters()

    def attach(self, optimizer: torch.optim.Optimizer, verdict_on_device: bool = False) -> torch.optim.Optimizer:
        """Count ``optimizer``'s state in the memory accounting and choose what a step does about
        non-finite gradients (:func:`~distlab.parallel.verdict.choose`): with ``verdict_on_device`` and an
        optimizer that can skip its update on the device (torch's fused kernels), the verdict stays there
        -- no wait for the device per step; :meth:`skipped_steps` reads it where the caller must know.
        Returns ``optimizer``."""
        self.grad_sync.track(optimizer)
        self.verdict = verdict.choose(self.precision, optimizer, verdict_on_device, self._find,
                                      self.non_finite_message)
        return optimizer

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    # ------------------------------------------------------------------ a step

    def no_sync(self):
        """Backward accumulates gradients locally and communicates nothing (all but the last micro-batch)."""
        return self.grad_sync.no_sync()

    def sync(self) -> None:
        """After the step's last backward: make every gradient (or gradient shard) the global mean."""
        t0 = time.perf_counter()
        with timeline.span("gradient sync"):  # on the training thread: the sync's own work and its waits
            self.grad_sync.sync_gradients()
        for component in self.components:  # the reductions the sync does not make (expert gradients)
            component.reduce_gradients()
        self.schedule.reduce_gradients(self)  # a pipeline's: parameters tied across its first and last stage
        self.sync_seconds = time.perf_counter() - t0

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale this step's gradients so that their global norm -- over the whole model, every
        parameter counted once, on any layout (:mod:`~distlab.parallel.clipping`) -- is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on one process; returns the norm before
        clipping (a 0-dim float32 tensor on the device, read when the caller wants). Call it between
        :meth:`forward_backward` (the gradients are then synced and, under fp16, unscaled) and
        :meth:`step`. A non-finite norm scales nothing: fp16 skips the step, :meth:`step` refuses it
        otherwise."""
        with timeline.span("clip by the global norm"):
            if not self._sharded:  # replicas of the whole reduced gradients: each rank's norm is the global one
                norm = clip_by_global_norm_(self.parameters(), self._unit_weights, max_norm, reduce=False)
            else:
                norm = clip_by_global_norm_(self.parameters(), self._norm_weights, max_norm)
        # The same verdict as step()'s pass over the gradients (one non-finite entry makes the norm
        # non-finite; float32 squares cannot overflow their float64 sum), for the price of one read.
        self.verdict.clipped(norm)
        return norm

    @functools.cached_property
    def _norm_weights(self) -> torch.Tensor:
        """Per optimizer parameter, one over the ranks holding the same elements (collective on first use)."""
        return torch.tensor(norm_weights(placement_of(self)), dtype=torch.float64, device=self.precision.device)

    @functools.cached_property
    def _unit_weights(self) -> torch.Tensor:
        return torch.ones(len(self.parameters()), dtype=torch.float64, device=self.precision.device)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()`` as the verdict decides, then what the layout needs after it (ZeRO 1-2:
        all-gather the updated shards) -- the one way to step. Returns whether the optimizer stepped.

        Non-finite gradients stop the run before the update (:class:`~distlab.errors.NonFiniteError`);
        under fp16 loss scaling a step whose gradients overflowed on any rank is skipped on every rank;
        with the verdict on the device (:meth:`attach`) that step and every later one is skipped there,
        and :meth:`skipped_steps` says so when read."""
        stepped = self.verdict.step(optimizer)
        t0 = time.perf_counter()
        self.grad_sync.after_step()  # ZeRO 1-2: all-gather the (updated or unchanged) shards
        self.sync_seconds += time.perf_counter() - t0
        return stepped

    def non_finite_message(self) -> str:
        fp32 = "" if self.strategy.precision == "fp32" else f", or train in fp32 (not {self.strategy.precision})"
        return ("the gradients are not finite (nan or inf) on some rank: the step was not applied; lower the "
                f"learning rate or check the data{fp32}")

    def _find(self, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        return verdict.found_non_finite(self, optimizer)

    def skipped_steps(self) -> int:
        """How many of the last steps the device skipped because a step's gradients were not finite (that
        one and every later one: 0 while all were finite) -- one read of a counter on the device, where
        :meth:`step` left the verdict there (:meth:`attach`); 0 otherwise."""
        return self.verdict.skipped()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         ignore_index: int | None = None, fields: Packed | None = None) -> torch.Tensor:
        """The step's forwards and backwards as the schedule runs them (``strategy.grad_accum``
        micro-batches, or the pipeline's ``strategy.microbatches``; every backward but the last under
        :meth:`no_sync`), then :meth:`sync`.

        The step equals one step on the whole local batch: each micro-batch loss is divided by their
        number. Returns this rank's mean loss over its samples as a 0-dim float64 tensor on the
        device (on a pipeline every rank returns the last stage's): reading it is the caller's
        choice, so a step waits for the device only where it must. Under context parallel ``x`` and
        ``y`` are whole sequences; the step runs on this rank's tokens of them (:meth:`shard`).

        ``ignore_index`` (targets that may be ignored: ``loss_fn`` scores none of them and takes
        ``reduction="sum"``): the step is that of the mean over the kept targets of the *global*
        batch, as one process computes it -- not a mean of micro-batch or rank means, which weigh a
        target by how many others its micro-batch kept (:func:`~distlab.parallel.loss_head.per_kept_target`).

        ``fields``: the batch's structure where it has one (a packed batch's :class:`~distlab.models.packing.Packed`),
        cut as the batch is and given to the model with each micro-batch's rows.
        """
        x, y = self.shard(x, y)
        fields = self.shard_fields(fields)
        if ignore_index is not None:
            loss_fn = per_kept_target(loss_fn, y, ignore_index, self.mesh, self.strategy.micro_steps)
        loss = self.schedule.forward_backward(self, x, y, loss_fn, fields)
        self.sync()
        # after the reduction (the same sums everywhere); only fp16's scaled gradients have anything to unscale
        self.verdict.unscale(self.parameters())
        return loss

    @property
    def needs_priming(self) -> bool:
        """Whether a resumed run must call :meth:`prime` before its first step to be bitwise."""
        return self.grad_sync.needs_priming

    def prime(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Before the first step of a resumed run: replay the backward after which torch's DDP re-cuts
        its buckets, so the resumed run reduces in the same buckets (:func:`~distlab.parallel.priming.prime`)."""
        if self.needs_priming:
            prime(self, x, y)

    # ------------------------------------------------------------------ state

    def convert_frozen(self, module: nn.Module, name: str, make) -> None:
        """Replace the frozen parameter ``name`` of ``module`` (a part of this rank's model) by ``make(its whole
        values)`` -- a base quantized once its values are in place -- through the gradient sync that holds it."""
        self.grad_sync.convert_frozen(module, name, make)

    def gathered(self, modules=None):
        """Context: the full parameters (``modules``: only their own) in place (collective under ZeRO-3; free
        otherwise)."""
        return self.grad_sync.gathered(modules)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process model's ``state_dict``: ZeRO and tensor-parallel shards gathered -- under ZeRO-3 a
        module at a time, each copied and let go, so a rank holds the copy and one module in full, not the whole
        model twice (collective: every rank calls it and gets it)."""
        state = full_state_dict(self.module, self.gathered)
        return dict(self.schedule.gather_model(list(state.items())))

    def full_parameters(self) -> list[torch.Tensor]:
        """Copies of the unsharded model's parameters in registration order (collective)."""
        with self.gathered():
            mine = full_parameters(self.module)
        keys = [k for k, _ in self.module.named_parameters()]
        return [t for _, t in self.schedule.gather_model(list(zip(keys, mine)))]

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (the whole model's keys; tensor-parallel pieces as held) -> their
        averaged gradient, unsharded by ZeRO (collective under ZeRO): between :meth:`forward_backward`
        and the next ``zero_grad``."""
        return {self.schedule.model_key(k): g for k, g in self.grad_sync.full_gradients().items()}

    def sharded_state_dict(self) -> dict:
        """This rank's part of the model state (a snapshot writes one per rank)."""
        return self.grad_sync.sharded_state_dict()

    def load_sharded_state_dict(self, state: dict) -> None:
        self.grad_sync.load_sharded_state_dict(state)

    def register_state(self, registry) -> None:
        """Register what a step carries to the next outside the model and optimizer with a run-state
        ``registry`` (:class:`distlab.train.registry.StateRegistry`): the gradient sync's compression
        memory (PowerSGD's error feedback and warm-start factors: this rank's, of this layout, so it
        starts afresh on another) and fp16's loss scaler. Snapshots keep them, so a resume continues
        bitwise."""
        registry.register("grad_sync", self.grad_sync.sync_state_dict, self._load_sync_state, reshard="fresh",
                          optional=True)
        self.precision.register_state(registry)

    def _load_sync_state(self, state: dict) -> None:
        if state:
            self.grad_sync.load_sync_state_dict(state)

    # ------------------------------------------------------------------ cost

    def observe(self) -> int:
        """Record the model-state bytes held now; returns the peak so far (see :attr:`peak_bytes`)."""
        return self.grad_sync.observe()

    @property
    def peak_bytes(self) -> int:
        """Peak bytes of parameters + gradients + optimizer state on this rank (ZeRO: tracked at
        every gather and reduce; data parallel: at the calls of :meth:`observe`)."""
        return self.grad_sync.peak_bytes

    def uncounted_bytes_per_step(self) -> int:
        """Bytes a rank sends per step that :mod:`distlab.comm` does not see (torch's DDP all-reduce,
        at its textbook volume); 0 for everything distlab sends itself."""
        return self.grad_sync.uncounted_bytes_per_sync()
