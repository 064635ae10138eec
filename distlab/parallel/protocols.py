"""The contract under the Engine: what a gradient sync and a step schedule provide.

An :class:`~distlab.parallel.Engine` holds one :class:`GradSync`, one :class:`StepSchedule`, an
ordered list of :class:`ModelSharding` components (context, expert and tensor parallel, and any
registered: :mod:`~distlab.parallel.components`), one
:class:`LossHead` and one :class:`~distlab.parallel.precision.Precision`, and calls nothing else of
them: it never asks which one it holds, nor whether one is there. Adding a strategy of either
kind is one class that implements the protocol (checked by ``isinstance(obj, GradSync)``:
``tests/test_protocols.py`` checks every implementation) and one row in the table
:func:`~distlab.parallel.parallelize` picks it from (a gradient sync: :data:`~distlab.parallel.grad_syncs.SYNC_KINDS`).

====================  ===========================================================================
``GradSync``          keeps the replicas of one model in step over the data-parallel group:
                      :class:`~distlab.parallel.DataParallel` (gather-scatter, allreduce, bucketed,
                      ddp) and :class:`~distlab.parallel.Zero` (stages 1, 2, 3) -- what a step needs
                      (8 members); the same object's state, placement and accounting are three more
                      small protocols: :class:`ShardedState`, :class:`StatePlacement`, :class:`StateCost`
``StepSchedule``      runs one optimizer step's forwards and backwards:
                      :class:`~distlab.parallel.schedule.Accumulate` (k micro-batches, one sync after
                      the last) and :class:`~distlab.parallel.schedule.Pipelined` (a
                      :class:`~distlab.parallel.PipelineStage`'s GPipe or 1F1B schedule)
``ModelSharding``     a parallelism that splits the model or its batch: context, expert and tensor
                      parallel, and any registered (:mod:`~distlab.parallel.components`)
``LossHead``          scores the output: the task's loss, or the vocabulary-parallel one
``ComponentKind``     what makes a ``ModelSharding`` component: a registered class (a base with the
                      defaults) that says when a strategy wants it, checks, applies, prices and
                      describes it
====================  ===========================================================================

A step, as the Engine runs it::

    loss = schedule.forward_backward(engine, x, y, loss_fn)  # every backward but the last in grad_sync.no_sync()
    grad_sync.sync_gradients()                                 # the global mean gradient (or this rank's shard of it)
    optimizer.step()                                           # over grad_sync.optimizer_parameters()
    grad_sync.after_step()                                     # ZeRO 1-2: all-gather the updated shards
"""

from __future__ import annotations

from typing import Callable, ContextManager, Protocol, runtime_checkable

import torch
from torch import nn

# (key, parameter, flat range) of one optimizer parameter: the local key of the model parameter it
# updates, that parameter, and the range of its flattened elements it holds (None: all of them).
Slot = tuple[str, nn.Parameter, "tuple[int, int] | None"]


@runtime_checkable
class GradSync(Protocol):
    """Keeps the data-parallel replicas of ``module`` in step: one object per model, made over the
    mesh's data-parallel group (the ranks that hold the same pipeline stage and tensor-parallel shard).
    What a step needs of it, and nothing else (the size of Megatron's data-parallel base); the same
    object also answers :class:`ShardedState`, :class:`StatePlacement` and :class:`StateCost`."""

    sharded: bool  # whether ranks of the group hold different model state (ZeRO) or the same (replicas)

    @property
    def module(self) -> nn.Module:
        """The model (its ``state_dict`` has the keys the module had before wrapping)."""

    @property
    def needs_priming(self) -> bool:
        """Whether a resumed run must replay one backward before its first step to be bitwise
        (torch's DDP re-cuts its buckets after the first step: :meth:`Engine.prime`)."""

    def __call__(self, *args, **kwargs): ...

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates on this rank (ZeRO: this rank's flat shards)."""

    def no_sync(self) -> ContextManager:
        """Backward inside accumulates local gradients and communicates nothing."""

    def sync_gradients(self) -> None:
        """After the step's last backward: every (shard of every) gradient is the group's mean."""

    def after_step(self) -> None:
        """After ``optimizer.step()``: what the layout needs (ZeRO 1-2: all-gather the shards)."""


@runtime_checkable
class ShardedState(Protocol):
    """A gradient sync's state, as this rank holds it: what a snapshot, an export and evaluation read."""

    def gathered(self, modules: list[nn.Module] | None = None) -> ContextManager[nn.Module]:
        """The full parameters in place for the duration (collective under ZeRO-3); ``modules``: only those
        modules' own parameters (``recurse=False``) -- a reader that walks the model a module at a time holds one
        module's in full, never the whole model's."""

    def offload_shards(self, store) -> int:
        """``--offload params``: this rank's parameter shards (and their reduced gradients) held in ``store``, an
        :class:`~distlab.parallel.offload.OffloadStore`; refused (ConfigError) where the sync holds none."""

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Parameter name -> its whole averaged gradient (collective under ZeRO), between
        ``sync_gradients`` and the next ``zero_grad``."""

    def sharded_state_dict(self) -> dict:
        """This rank's part of the model state (plain tensors; a snapshot writes one per rank)."""

    def load_sharded_state_dict(self, state: dict) -> None: ...

    def sync_state_dict(self) -> dict:
        """What the sync carries from one step to the next (compression memory); ``{}`` if nothing."""

    def load_sync_state_dict(self, state: dict) -> None: ...

    def convert_frozen(self, module: nn.Module, name: str, make: Callable[[torch.Tensor], nn.Parameter]) -> None:
        """Replace ``module``'s frozen parameter ``name`` by ``make(its whole values)`` (a base quantized once its
        values are in place), held whole on this rank from then on, its state dicts holding its values (a
        quantized tensor's dequantized)."""


@runtime_checkable
class StatePlacement(Protocol):
    """Where a gradient sync's tensors sit in the whole model: what lets a snapshot change layout
    (:mod:`distlab.parallel.placement` reads it)."""

    def parameter_slots(self) -> list[Slot]:
        """Each optimizer parameter's :data:`Slot`, in ``optimizer_parameters`` order."""

    @staticmethod
    def reads(state: dict) -> bool:
        """Whether ``state`` is a ``sharded_state_dict`` of this kind (of any group size)."""

    @staticmethod
    def split_state(state: dict, keys: list[str]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """A ``sharded_state_dict`` of this kind as (the optimizer parameters' tensors, buffers)."""

    def state_from(self, params: list[torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict:
        """The ``sharded_state_dict`` that holds ``params`` (slot order) and ``buffers``."""


@runtime_checkable
class StateCost(Protocol):
    """What a gradient sync holds and sends that a run reports (its planned cost sits beside it:
    ``DataParallelCost``, ``ZeroCost``)."""

    peak_bytes: int  # the most parameter + gradient + optimizer-state bytes held so far on this rank

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state in :attr:`peak_bytes`."""

    def observe(self) -> int:
        """Record the model-state bytes held now; returns :attr:`peak_bytes`."""

    def uncounted_bytes_per_sync(self) -> int:
        """Bytes a rank sends per sync that :mod:`distlab.comm` does not count (torch's DDP)."""


@runtime_checkable
class StepSchedule(Protocol):
    """How one optimizer step's forwards and backwards run, and how this rank's keys map to the
    whole model's (a pipeline stage holds some of its layers under its own keys)."""

    def forward_backward(self, engine, x: torch.Tensor, y: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         fields=None) -> torch.Tensor:
        """Forwards and backwards of this rank's batch, every backward but the last under
        ``engine.no_sync()``; gradients not yet synced; ``fields`` (the batch's structure, a packed batch's
        :class:`~distlab.models.packing.Packed`, or None) bound to the model with each micro-batch's rows
        (:func:`~distlab.models.packing.bind`) before its forward and its backward. Returns this rank's mean
        loss as a 0-dim float64 tensor (every rank of a pipeline returns the same)."""

    def infer(self, engine, x: torch.Tensor, fields=None) -> torch.Tensor | None:
        """The model's output for one batch (structure ``fields``) without gradients, where it is known (a
        pipeline's last stage), None elsewhere. Every rank calls it once per batch."""

    def model_key(self, key: str) -> str:
        """A key of this rank's ``state_dict`` (or a module name) as the whole model's."""

    def gather_stages(self, mine: object) -> list:
        """Every pipeline rank's ``mine``, in rank order (collective over the pipeline; ``[mine]``
        without one)."""

    def gather_model(self, pairs: list[tuple[str, object]]) -> list[tuple[str, object]]:
        """``(key of this rank's module, value)`` pairs of every rank, as ``(the whole model's key,
        value)`` in the model's order (collective over the pipeline; interleaved chunks included)."""

    def stages(self) -> list[dict]:
        """The pipeline's stages (layer ranges, names, parameters); ``[]`` without a pipeline."""

    def reduce_gradients(self, engine) -> None:
        """After the gradient sync: the reductions the schedule's cut needs (a tied embedding and LM head
        on the first and last stage: their gradients summed); nothing without a pipeline."""

    tied: dict[str, str]  # the whole model's name of a parameter held again under another -> that one

    def report(self, warmup: int, device: torch.device | str) -> dict:
        """What the schedule measured, for summary.json (collective over the world; ``{}`` if nothing)."""


@runtime_checkable
class ModelSharding(Protocol):
    """A parallelism that splits the model or its batch beside the gradient sync and the schedule
    (context parallel: each sequence's tokens; expert parallel: the experts). The Engine holds them
    in one ordered list and calls every one of them at the same points of a step:

    * :meth:`prepare_batch` before the forward (and evaluation's), in list order;
    * :meth:`reduce_gradients` after the gradient sync -- the reductions the sync does not make (one
      place after backward, as Megatron's ``finalize_model_grads``);
    * :attr:`lockstep` -- whether its forward exchanges data between data-parallel ranks, so every
      rank must run every batch (evaluation pads the shorter shards with empty ones).
    """

    lockstep: bool

    def prepare_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of each batch tensor (the tensors themselves where nothing is split)."""

    def reduce_gradients(self) -> None:
        """After the gradient sync: this parallelism's own reductions (nothing where it has none)."""


@runtime_checkable
class LossHead(Protocol):
    """Scores the model's output: the task's loss and accuracy (computed across the vocabulary shards
    where tensor parallel split the LM head, so no rank builds the full logits)."""

    def loss(self, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean",
             label_smoothing: float = 0.0) -> torch.Tensor: ...

    def correct(self, out: torch.Tensor, y: torch.Tensor) -> tuple[int, int]: ...


@runtime_checkable
class ShardedLayer(Protocol):
    """A layer whose parameters each rank of ``group`` holds a part of -- tensor parallel's column,
    row and vocabulary-parallel layers, expert parallel's expert shards -- and that puts them back
    together itself. What reads whole state (the Engine's ``full_state_dict`` and ``full_parameters``,
    :func:`~distlab.parallel.placement.placement_of` for snapshots and resharding) asks this protocol
    only, never which strategy made the layer.

    Two more attributes the parallelisms set, read by whoever must know (plain attributes, not
    members of a class):

    * ``parameter.sync_group`` -- a parameter replicated over a group of its own (an expert shard over
      its expert-data group): data parallel and ZeRO leave it out, its owner reduces it, the global
      gradient norm counts it once per that group;
    * ``module.sequence_group`` -- a module that computes statistics over a sequence split by context
      parallel (its tokens' share of a mean or a sum) reduces them over this group;
    * ``parameter.from_values(values)`` -- what a state dict's ``values`` become before they are copied into a
      parameter that is not made from its own values alone (a tensor-parallel part of a 4-bit weight: the
      group's values quantized whole; collective over the layer's group).
    """

    tp_split: dict[str, int]  # parameter name -> the dimension its shards split (the rest are replicated)
    group: object  # the process group over whose ranks the shards are spread

    def full_parameters(self) -> list[torch.Tensor]:
        """Its parameters in registration order, whole (collective over ``group``)."""

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of its split parameter ``name`` (:func:`split_shape` where the parts are equal; a
        vocabulary ``tp`` does not divide is cut as ``torch.chunk`` cuts it, the last part the smaller)."""


@runtime_checkable
class LowRankAdapted(Protocol):
    """A linear layer with a trained low-rank update beside its frozen weight (LoRA:
    :class:`distlab.models.lora.LoRALinear`): ``y = x W^T + b + adapter(...)``. Tensor parallel asks this,
    never which converter made the layer: a column-parallel layer splits ``lora_b`` with its rows, a
    row-parallel one ``lora_a`` with its columns, and each computes its part of the update with the same
    ``adapter`` -- the row-parallel layer's partial update joins its weight's partial output in the one
    all-reduce (no collective of its own)."""

    lora_a: nn.Parameter  # (r, in_features)
    lora_b: nn.Parameter  # (out_features, r)
    # adapter(result, x, a, b, training): ``result`` plus the update of ``x`` through factors ``a``, ``b``
    adapter: Callable[..., torch.Tensor]


def value_copy(p: torch.Tensor) -> torch.Tensor:
    """A copy of a parameter's values: a quantized one's (a tensor that dequantizes itself with
    ``get_original_weight``: torchao's NF4 weight, whole or a tensor-parallel part) dequantized."""
    return p.get_original_weight() if hasattr(p, "get_original_weight") else p.detach().clone()


def split_shape(layer, name: str) -> tuple[int, ...]:
    """The whole shape of ``layer``'s parameter ``name`` split in equal parts along ``layer.tp_split[name]``
    over ``layer.group``: its own shape with that dimension times the parts."""
    from distlab.runtime import group_size
    shape = list(layer.get_parameter(name).shape)
    shape[layer.tp_split[name]] *= group_size(layer.group)
    return tuple(shape)


class ComponentKind:
    """A model-sharding parallelism's *kind*: the class registered in :mod:`~distlab.parallel.components`
    that makes the :class:`ModelSharding` component. Subclass it and override what is yours; the rest
    is the default, the no-op where one is right:

    ``name``                       its word in a strategy's text form (``+NAME``)
    ``dim``                        the mesh dimension it owns: a strategy field (``cp``, ``ep``, ``tp``) or,
                                   for a registered kind, its own name (its size written ``+NAME=N``,
                                   kept in ``strategy.dims``; the mesh makes the dimension, between the
                                   data- and the context-parallel one); None where it has none
    ``replicates``                 whether the ranks along its own dimension hold the same part of the
                                   model (gradients averaged and ZeRO shards over them; the data loader
                                   gives them the same batch) -- default False: they hold different parts
    ``wanted(strategy)``           whether a strategy turns it on: ``dim`` above 1, else ``name`` listed in
                                   ``strategy.components``
    ``check(model, strategy, input_shape)``  before launch, on the model built on the meta device:
                                   raise :class:`~distlab.errors.ConfigError` naming what does not fit
                                   (default: nothing to check)
    ``apply(model, strategy, mesh)``  change the built, seeded model in place or return a new one;
                                   returns ``(model, component)`` -- the one method without a default
    ``price(t, t_rank, lay, micro, optim)``  what it costs ``distlab plan`` (a
                                   :class:`~distlab.parallel.cost.Price`); the default refuses: the
                                   planner never leaves a parallelism out silently
    ``describe(engine)``           the run header's lines about it (default: none)
    ``report(engine)``             what the run's summary keeps about it, under ``components.NAME``
                                   (default: nothing)
    """

    name: str = ""
    dim: str | None = None
    replicates: bool = False

    @classmethod
    def wanted(cls, strategy) -> bool:
        return strategy.size(cls.dim) > 1 if cls.dim else cls.name in strategy.components

    @classmethod
    def check(cls, model: nn.Module, strategy, input_shape: tuple[int, ...]) -> None:
        return None

    @classmethod
    def apply(cls, model: nn.Module, strategy, mesh) -> tuple[nn.Module, ModelSharding]:
        raise NotImplementedError(f"component kind {cls.__name__} does not say how it applies (apply)")

    @classmethod
    def price(cls, t, t_rank, lay, micro: int, optim):
        from distlab.errors import ConfigError
        raise ConfigError(f"component {cls.name} cannot be planned yet: its kind {cls.__name__} has no price; plan "
                          f"the layout without it")

    @classmethod
    def describe(cls, engine) -> list[str]:
        return []

    @classmethod
    def report(cls, engine) -> dict:
        return {}
