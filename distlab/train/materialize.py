"""The one room that makes the model a run trains, from its config: the family built on the meta device (or
whole where it cannot be replayed, or from a file), the fine-tuning features applied as **converters** to the
whole model before the layout cuts it -- low-rank adapters with their frozen base's dtype, QLoRA's 4-bit base
once the values are in place -- then cut by :func:`~distlab.parallel.parallelize` and given its values: the
replayed initialisation, a Hugging Face checkpoint's slices, a file, PEFT's adapters. Each rank holds only its
part while it loads, and the values are those of one process's build, bitwise (``verify`` rests on it). No
other room knows which of these paths a run took.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol

import torch
from torch import nn

from distlab.models import build_model, count_parameters, snapshot_record
from distlab.parallel import parallelize
from distlab.parallel.placement import state_from_full, state_from_stream
from distlab.parallel.offload import OffloadStore, check_offload
from distlab.runtime import seed_everything
from distlab.train.fine_tuning import attach as attach_adapters
from distlab.train.export import init_slices, load_init
from distlab.train.muon import matrix_names
from distlab.train.optim import decay_groups, no_decay_names
from distlab.train.quantized_base import quantize as quantize_base
from distlab.train.throughput import Throughput


class Converter(Protocol):
    """A feature that changes the model: applied to the whole model before the layout cuts it, and told when
    every value is in place on the layout."""

    def convert(self, net: nn.Module, real: bool) -> dict[str, torch.Tensor]:
        """Change ``net`` (the whole model, on the meta device unless ``real``); return the starting values of
        the tensors it added, by state key (given to ``net`` now where it is ``real``, else cut with its state)."""

    def placed(self, engine) -> None:
        """After the layout's engine holds every value (``engine.module``: this rank's model)."""


class Adapters:
    """``lora`` (and ``lora_from``, ``base_dtype``): low-rank adapters on the target layers, the base frozen in
    its dtype (:func:`distlab.train.fine_tuning.attach`)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def convert(self, net: nn.Module, real: bool) -> dict[str, torch.Tensor]:
        return attach_adapters(self.cfg, net, real)

    def placed(self, engine) -> None:
        pass


class QuantizedBase:
    """``base_dtype`` nf4: each adapted layer's frozen weight quantized once its values are in place (QLoRA)."""

    def convert(self, net: nn.Module, real: bool) -> dict[str, torch.Tensor]:
        return {}

    def placed(self, engine) -> None:
        quantize_base(engine.module, engine.convert_frozen)


class OffloadedShards(Converter):
    """``offload`` params: ZeRO-3's shards moved into the run's offload store once their values are in place."""

    def __init__(self, store):
        self.store = store

    def convert(self, net: nn.Module, real: bool) -> dict[str, torch.Tensor]:
        return {}

    def placed(self, engine) -> None:
        engine.grad_sync.offload_shards(self.store)


def converters(cfg, offload=None) -> list[Converter]:
    """The converters ``cfg`` asks for, in the order they apply (``offload``: the run's offload store)."""
    return [*([Adapters(cfg)] if cfg.lora is not None else []),
            *([QuantizedBase()] if cfg.base_dtype == "nf4" else []),
            *([OffloadedShards(offload)] if cfg.offload == "params" else [])]


@dataclass
class Materialized:
    """The engine of the run's model and what was read of the whole model before the layout cut it."""

    engine: object
    num_parameters: int
    num_trainable: int
    record: dict  # the model's own sizes (a snapshot's layout)
    throughput: Throughput  # tokens/s and MFU, from the whole model
    no_decay: set[str]  # parameters kept out of weight decay, by the whole model's names
    matrices: set[str] = field(default_factory=set)  # --optimizer muon: what Muon steps (the rest AdamW)
    offload: OffloadStore | None = None  # --offload: where the optimizer's state (and the shards) live
    # what computes with the model outside its steps runs under this (a frozen base held in bf16: autocast)
    narrow: Callable[[], ContextManager] = contextlib.nullcontext


def materialize(cfg, rt, train_set, mesh) -> Materialized:
    """The model ``cfg`` trains on ``mesh``, on ``rt``'s device, its values in place (module docstring)."""
    seed_everything(cfg.seed)
    make = functools.partial(build_model, cfg.model, train_set.input_shape, cfg.vocab(train_set.num_classes),
                             **cfg.model_options())
    from distlab.models.deferred import deferred  # loads with the model, not with the training layer
    weights = cfg.weights_from()  # (None where a resumed snapshot holds every weight)
    net, init = deferred(make) if cfg.strategy.deferrable and (not weights or weights.startswith("hf:")) \
        else (make(), None)
    slices = init_slices(net, weights) if weights else None
    if weights and slices is None:  # a file loaded whole, or a build that cannot be replayed, is built whole
        net = init.fill(net) if init is not None else net
        init = None
        load_init(net, weights)
    if init is None:
        net = net.to(rt.device)
    offload = None
    if cfg.offload != "none":  # (checked again here: the device is this rank's)
        check_offload(cfg.offload, cfg.offload_dir, cfg.strategy.zero, rt.device.type)
        offload = OffloadStore(cfg.offload_dir, rt.rank)
    chosen = converters(cfg, offload)
    added: dict[str, torch.Tensor] = {}
    for converter in chosen:
        added |= converter.convert(net, init is None and slices is None)
    if added and slices is not None:
        slices = {**slices, **added}
    made = Materialized(None, count_parameters(net), sum(p.numel() for p in net.parameters() if p.requires_grad),
                        snapshot_record(net), Throughput.of(net, train_set, cfg, rt),
                        no_decay_names(net) if decay_groups(cfg) else set(),
                        matrix_names(net) if cfg.optimizer == "muon" else set(), offload=offload)
    made.engine = engine = parallelize(net, cfg.strategy, mesh, rt.device)
    if cfg.base_dtype != "float32":
        made.narrow = engine.precision.autocast
    if init is not None:  # (a checkpoint's run draws no random numbers for weights it never uses)
        stream = itertools.chain(init.tensors(), (([k], v) for k, v in added.items()))
        engine.load_sharded_state_dict(state_from_full(engine, slices, device=rt.device) if slices is not None
                                       else state_from_stream(engine, stream, device=rt.device))
    elif slices is not None:
        engine.load_sharded_state_dict(state_from_full(engine, slices))
    for converter in chosen:
        converter.placed(engine)
    return made
