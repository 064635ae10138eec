"""``parallelize(model, strategy, mesh) -> Engine``: the composition root, where a Strategy becomes parts.

:func:`parallelize` applies, in this order:

0. **decisions on the unsharded model**: the pipeline's cut (where the model's parameters balance,
   so every rank of a tensor-parallel group cuts at the same layers) and the blocks activation
   checkpointing recomputes (:mod:`~distlab.parallel.checkpointing`: ``state_dict`` unchanged);
1. **the model-sharding components** the strategy turns on, in the registry's order
   (:mod:`~distlab.parallel.components`): context parallel over the mesh's CP group (the Engine then
   cuts every batch to this rank's tokens), expert parallel over its EP group (the experts'
   gradients then reduced over their own replicas), tensor parallel over its TP group (shards
   sliced from the full, seeded model, so it computes what the unsharded one does), then any
   registered beside them;
2. **the loss head**: the task's loss, or the vocabulary-parallel one where tensor parallel split
   the LM head (before the cut: the loss needs it on the last stage);
3. **the step schedule**: accumulation, or this rank's pipeline stage
   (:class:`~distlab.parallel.PipelineStage`) running its schedule;
4. **SyncBN over the data-parallel group** (under tensor parallel the ranks of a TP group see
   the same samples: reducing statistics over the world would count each sample ``tp`` times);
5. **the gradient sync**: data parallel or ZeRO over the replica group (the data- and
   context-parallel ranks holding the same stage and tensor-parallel shard) -- or, hybrid sharding, ZeRO
   over a shard group of them, its shards replicated across the groups;
6. **precision**: autocast, and fp16's loss scaling (a no-op for fp32 and bf16).

Every choice between kinds happens here and nowhere else: the :class:`~distlab.parallel.Engine`
calls what the protocols promise and never asks which kind it holds.
"""

from __future__ import annotations

import torch
from torch import nn

from distlab.parallel import components as registry
from distlab.parallel.checkpointing import apply_activation_checkpointing, block_names
from distlab.parallel.compile import apply_compile, whole_model
from distlab.parallel.engine import Engine
from distlab.parallel.grad_syncs import reader_of, sync_kind
from distlab.parallel.loss_head import loss_head
from distlab.parallel.mesh import Mesh
from distlab.parallel.pipeline import PipelineStage, partition
from distlab.models.plans import tied_names
from distlab.parallel.precision import Precision, check_device
from distlab.parallel.protocols import ModelSharding, StepSchedule
from distlab.parallel.schedule import Accumulate, Pipelined
from distlab.parallel.strategy import Strategy
from distlab.parallel.sync_bn import apply_sync_bn


def parallelize(model: nn.Module, strategy: Strategy, mesh: Mesh, device: torch.device | None = None) -> Engine:
    """Spread ``model`` (built and seeded the same way on every rank) over ``mesh`` as ``strategy`` says.

    Starts from rank 0's weights (data parallel and ZeRO broadcast them over the data-parallel
    group), so every replica begins equal. A model built on the meta device is cut as it is, and ``device``
    names where its values will live: each rank then loads only its part
    (:meth:`~distlab.parallel.Engine.load_sharded_state_dict`, from
    :func:`~distlab.parallel.placement.state_from_stream`).
    """
    strategy.check(mesh.world_size)
    dims = ("tp", "pp", "cp", "ep", *(name for name, _ in strategy.dims), *mesh.dims)
    if any(mesh.size(d) != strategy.size(d) for d in dims):
        raise ValueError(f"the mesh has {', '.join(f'{d} {mesh.size(d)}' for d in dims)} but the strategy "
                         f"{', '.join(f'{d} {strategy.size(d)}' for d in dims)}: build the mesh from the strategy "
                         f"(Mesh.of(strategy))")
    device = device if device is not None else next(model.parameters()).device
    check_device(strategy.precision, device)
    if strategy.pp > 1:  # cut by the unsharded model's parameters: the same layers on every rank of a TP group
        balance = [end - start for start, end in partition(model, strategy.pp * strategy.pp_virtual,
                                                            strategy.pp_balance)]
    blocks = block_names(model, strategy.ac_every) if strategy.activation_checkpointing and strategy.pp > 1 else None
    parts: list[ModelSharding] = []  # in the order they act on a batch
    for kind in registry.wanted(strategy):
        model, part = kind.apply(model, strategy, mesh)
        parts.append(part)
    if strategy.activation_checkpointing and strategy.pp == 1:  # a stage checkpoints its blocks by name
        apply_activation_checkpointing(model, strategy.ac_every, strategy.ac_policy)
    if strategy.compile:  # in place, inside the checkpointed ranges and the stage's layers alike
        apply_compile(model, whole_model(strategy, mesh.replicas, len(parts)), strategy.compile_backend)
    head = loss_head(model)
    schedule: StepSchedule = Accumulate(strategy.grad_accum)
    if strategy.pp > 1:
        ties = tied_names(model)  # before the cut: a tied embedding and LM head land on two stages
        model = PipelineStage(model, mesh.pp_group, strategy.microbatches, strategy.pp_schedule, balance,
                              strategy.pp_virtual, blocks, strategy.ac_policy)
        schedule = Pipelined(model, mesh, ties)
    model = apply_sync_bn(model, strategy.sync_bn, mesh.replica_group)
    grad_sync = sync_kind(strategy).wrapper.from_strategy(model, strategy, mesh.shard_group,
                                                          replicate=mesh.replicate_group)
    return Engine(grad_sync, schedule, strategy, mesh, Precision(strategy.precision, device), tuple(parts), head)


def split_sharded_state(state: dict, placement: dict) -> tuple[list, dict]:
    """A :meth:`~distlab.parallel.Engine.sharded_state_dict` (of any layout, described by its
    ``placement``) as its optimizer parameters' tensors and its buffers under the whole model's keys."""
    params, buffers = reader_of(state).split_state(state, placement["keys"])
    return params, {placement["buffers"][k]: v for k, v in buffers.items() if k in placement["buffers"]}
