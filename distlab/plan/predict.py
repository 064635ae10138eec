"""``distlab plan``: a layout's memory per rank and time per step, and sweeps over world sizes.

:func:`predict` turns a model :class:`~distlab.parallel.cost.Trace`, a :class:`Layout` and a
:class:`~distlab.plan.machine.Link` into memory per rank (exact for DP and ZeRO) and, with a
:class:`~distlab.plan.calibration.Calibration`, time per step; :func:`sweep` walks world sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from distlab.errors import ConfigError
from distlab.parallel import Strategy, components
from distlab.parallel.cost import Optim, textbook_parts, under
from distlab.parallel.pipeline import cost as schedule_cost
from distlab.parallel import sync_bn
from distlab.parallel.grad_syncs import sync_kind
from distlab.parallel.step_ahead import check_overlap
from distlab.parallel.zero.hsdp import shard_ways
from distlab.plan import offload, rollout
from distlab.plan.calibration import Calibration
from distlab.plan.machine import Link, sent
from distlab.plan.timing import CalibratedHost, step_time
from distlab.plan.trace import Trace, units_trace


@dataclass(frozen=True)
class Layout:
    """What to predict for: data-parallel size, the strategy (tp, ZeRO, sync method ...), batch, optimizer."""
    dp: int = 1
    strategy: Strategy = Strategy()
    optimizer: str = "sgd"
    momentum: float = 0.9
    optimizer_state: str = "fp32"  # adam/adamw: the moments' dtype (bf16: 2 bytes each)
    offload: str = "none"  # optimizer | params: the optimizer's state (and ZeRO-3's shards) off the device
    offload_overlap: bool = False  # the offloaded step beside the next step's first forward (parallel.step_ahead)
    global_batch: int = 64
    threads: int | None = None
    oversubscription: float = 1.0  # ranks x threads per core on the busiest host: compute runs this much slower
    ignored_targets: bool = False  # some targets are not scored (a fine-tuning prompt's): their count is reduced
    label_smoothing: bool = False  # the loss smooths its labels: one more reduction per token across a split vocabulary
    pairs: bool = False  # a sample is a preference pair (DPO): two windows, their log-probabilities summed per row
    group: int = 1  # a sample is a prompt (GRPO): its rollout trains `group` completions, a window each
    max_new_tokens: int = 0  # GRPO: each completion's budget (0: half the window)
    kl_beta: float = 0.0  # GRPO: a KL penalty (the rollout scores the rows under the reference too)
    ppo_epochs: int = 1  # GRPO: passes over a rollout (above 1 it scores the rows' old log-probabilities)

    def check(self) -> "Layout":
        if self.dp < 1:
            raise ConfigError(f"`dp` {self.dp} must be at least 1")
        self.strategy.check(self.world)
        self.strategy.check_batch(self.global_batch, self.world)
        check_overlap(self.offload_overlap, self.offload, self.strategy, self.optimizer)
        return self

    @property
    def world(self) -> int:
        return self.dp * self.strategy.model_ways

    @property
    def replicas(self) -> int:
        """Ranks that hold the same part of the model: data x context parallel (x the extra dimensions
        that replicate it)."""
        return self.dp * self.strategy.replica_ways

    @property
    def zero_shard(self) -> int:
        """The ranks ZeRO shards over: every replica, or (hybrid sharding) a shard group of them."""
        return shard_ways(self.strategy, self.replicas)

    tp = property(lambda self: self.strategy.tp)
    pp = property(lambda self: self.strategy.pp)
    cp = property(lambda self: self.strategy.cp)
    ep = property(lambda self: self.strategy.ep)
    zero = property(lambda self: self.strategy.zero)
    dp_sync = property(lambda self: self.strategy.dp_sync)
    collective = property(lambda self: self.strategy.collective)
    bucket_mb = property(lambda self: self.strategy.bucket_mb)
    grad_accum = property(lambda self: self.strategy.grad_accum)


def grad_sync_cost(strategy: Strategy):
    """The cost model of the gradient sync :func:`~distlab.parallel.parallelize` builds for ``strategy``
    (each says what it sends, ``planned_calls``, and holds, ``planned_memory``): the same table's row."""
    return sync_kind(strategy).cost


def stage_names(t: Trace, stage: dict) -> set[str]:
    """The parameter names under a pipeline stage's layers (a tied one's second name included)."""
    layers = [layer.name for a, b in stage.get("chunks") or [stage["layers"]] for layer in t.layers[a:b]]
    return {name for name in (*t.names, *t.tied) if under(name, set(layers), strict=True)}


def dense_trace(t: Trace, lay: Layout) -> Trace:
    """What the gradient sync reduces of a rank's trace ``t``: all of it but expert parallel's shards (their own
    group's, reduced by their owner)."""
    experts = set(t.expert_names) if lay.ep > 1 else set()
    return units_trace(t, [u for u, n in enumerate(t.names) if n not in experts]) if experts else t


def state_parts(t_rank: Trace, lay: Layout, sync, optim) -> dict[str, int]:
    """The textbook split (ZeRO paper, table 1) of what each kind comes to between steps, as the gradient sync
    shards it, on the units this rank holds (tensor parallel's and expert parallel's already split); expert
    shards whole, as data parallel holds them (their own group's)."""
    flags = t_rank.trainable or [True] * len(t_rank.numels)
    experts = set(t_rank.expert_names) if lay.ep > 1 else set()
    dense = [u for u, n in enumerate(t_rank.names) if n not in experts]
    parts = sync.planned_parts([t_rank.numels[u] for u in dense], optim, t_rank.element_size, lay.strategy,
                               lay.replicas, [flags[u] for u in dense], [t_rank.tensors(u) for u in dense],
                               [t_rank.matrix(u) for u in dense])
    held = [u for u in range(len(t_rank.names)) if u not in set(dense)]
    whole = textbook_parts([t_rank.numels[u] for u in held], optim, t_rank.element_size, 0, lay.replicas,
                           [flags[u] for u in held], [t_rank.tensors(u) for u in held],
                           [t_rank.matrix(u) for u in held])
    return {k: v + whole[k] for k, v in parts.items()}


def comm_bytes(t: Trace, lay: Layout, sync, stages: list[dict], micro: int, optim) -> dict:
    """The bytes the first rank (the first pipeline stage, tensor-parallel rank 0) sends in a step --
    what a run counts on it (``comm_bytes_per_step`` of its summary) -- by sender: the gradient sync's
    collectives on its stage's parameters, each component's, the stage's messages to its neighbours,
    and the count of kept targets where some are ignored (:func:`~distlab.plan.machine.sent` of each call)."""
    first = stages[0]["trace"]
    experts = set(first.expert_names) if lay.ep > 1 else set()  # expert shards: left out of the gradient sync
    calls = sync.planned_calls(dense_trace(first, lay), lay.strategy, lay.replicas)
    every = (*calls.before_layers, *calls.during_backward, *calls.after_backward, *calls.after_step)
    by = {"gradient_sync": sum(sent(c.algorithm, c.ranks or lay.replicas, c.nbytes, c.kind) for c in every
                               if c.span != "replicate")}
    if any(c.span == "replicate" for c in every):  # hybrid sharding: what crosses the shard groups, apart
        by["across_shard_groups"] = sum(sent(c.algorithm, c.ranks, c.nbytes, c.kind) for c in every
                                        if c.span == "replicate")
    for kind in components.wanted(lay.strategy):  # each priced on this stage's part of the model
        price = kind.price(t, first, lay, micro, optim)
        by[kind.name] = sum(g.hops * sent(c.algorithm, g.ranks, c.nbytes, c.kind) for g in price.calls for c in g.calls)
    if experts:  # this rank's expert shards (its trace's), summed over the replicas that hold the same ones
        shard = sum(n for name, n in zip(first.names, first.numels) if name in experts) * first.element_size
        by["ep"] = by.get("ep", 0) + sent("native", lay.replicas // lay.ep, shard, "all_reduce")
    if lay.strategy.sync_bn != "off":
        by["sync_bn"] = sum(sent(c.algorithm, lay.replicas, c.nbytes, c.kind, c.itemsize)
                            for c in sync_bn.planned_calls(first, lay.strategy))
    if lay.pp > 1:
        by["pipeline"] = stages[0]["sent_bytes_per_step"]
        for second, first_name in t.tied.items():  # a tied parameter's copy on another stage: its gradient summed
            if second not in stage_names(t, stages[0]) and first_name in first.names:
                numel = first.numels[first.names.index(first_name)]
                numel = math.ceil(numel / lay.zero_shard) if lay.zero else numel  # ZeRO: the shards
                by["tied"] = by.get("tied", 0) + sent("native", 2, numel * first.element_size, "all_reduce")
    if lay.optimizer == "muon":  # each matrix cut over ranks gathered to its owner and its update scattered back
        by["optimizer"] = muon_bytes(t, first, lay)
    if lay.ignored_targets:  # the global batch's kept targets, counted once per step over the replicas
        by["kept_targets"] = sent("native", lay.replicas, 4, "all_reduce")
    if lay.pairs and lay.cp > 1 and lay.pp == 1:  # DPO: each micro-batch's rows' log-probability sums (float32)
        # and their reference's (float64), summed over the context-parallel ranks
        by["preference"] = lay.strategy.micro_steps * sum(sent("native", lay.cp, micro * size, "all_reduce")
                                                          for size in (4, 8))
    return {"comm_bytes_per_step_per_rank": int(round(sum(by.values()))),
            "comm_bytes_by": {k: int(round(v)) for k, v in by.items()}}


def muon_bytes(t: Trace, first: Trace, lay: Layout) -> int:
    """What the first rank sends for Muon's whole matrices (:func:`distlab.train.muon.orthogonalised`): per matrix
    cut over ranks -- ZeRO's flat shards over its group, then a tensor-parallel split -- the ``i``-th owned by
    rank ``i mod n`` at each level; a rank sends its piece to the owner, the owner every other rank's piece back."""
    experts = set(first.expert_names) if lay.ep > 1 else set()
    split = t.tensor_split.get(t.tensor_key(lay.strategy, lay.tp)) if lay.tp > 1 else set()
    s, total, i = (lay.zero_shard if lay.zero else 1), 0, 0
    for u, name in enumerate(first.names):
        if not (first.matrix(u) and first.trains(u)):
            continue
        flat = s > 1 and name not in experts  # (an expert shard is held whole by ZeRO)
        tp = lay.tp > 1 and (split is None or name in split) and name not in experts
        if not (flat or tp):
            continue
        owner_here = True
        if flat:
            piece = math.ceil(first.numels[u] / s) * first.element_size
            owner_here = i % s == 0
            total += (s - 1) * piece if owner_here else piece
        if tp and owner_here:  # (the slices' owners alone meet at this level)
            piece = first.numels[u] * first.element_size
            total += (lay.tp - 1) * piece if i % lay.tp == 0 else piece
        i += 1
    return total


def loss_bytes(t: Trace, lay: Layout, micro: int, narrow: float) -> float:
    """What the loss adds on the rank that computes it (the last stage), at the start of backward, beyond what
    the activations count: its log-probabilities stay float32 under autocast (the half the activations' halving
    took back) and its backward holds two more tensors that size at once -- per micro-batch, the vocabulary split
    where tensor parallel splits the head, the tokens where context parallel splits the sequence."""
    if not t.loss_grad_bytes_per_sample:
        return 0.0
    plan = t.tensor_plans.get(t.tensor_key(lay.strategy, lay.tp), {}) if lay.tp > 1 else {}
    split = lay.tp if "vocab_output" in plan.values() else 1
    return (t.loss_bytes_per_sample * (1 - narrow) + t.loss_grad_bytes_per_sample) * micro / split / lay.cp


def load_peak(t: Trace, parts: dict, strategy) -> int:
    """The most model a rank holds while it loads, before its first step: its parameters as the layout places
    them and the largest tensor whole (made or read, then cut: :mod:`distlab.models.deferred`) -- or the whole
    model, where it is built whole first (torch's DDP wraps real tensors)."""
    if not strategy.deferrable:
        return t.num_parameters * t.element_size
    return parts["parameter_bytes_per_rank"] + max(t.numels) * t.element_size


def predict(t: Trace, lay: Layout, link: Link, cal: Calibration | None, cluster=None) -> dict:
    """Memory per rank and (with a calibration, or on a GPU ``cluster``: :class:`~distlab.plan.gpu.Cluster`)
    time per step of ``lay`` over ``link`` (or the cluster's NVLink and network): the model state, activations
    and bytes each part of the layout prices for itself, then the step timed on the machine (a
    :class:`~distlab.plan.timing.Machine`)."""
    lay.check()
    if cluster is not None:
        cluster.check(lay)
    micro = lay.global_batch // lay.dp // lay.strategy.micro_steps * (2 if lay.pairs else lay.group)  # rows
    optim = Optim.of(lay.optimizer, lay.momentum, lay.optimizer_state, lay.offload)
    if lay.strategy.activation_checkpointing and not (t.blocks and t.layers):
        raise ConfigError("`activation_checkpointing`: plan counts what each layer keeps, and this model lists no "
                          + ("blocks (checkpoint_blocks)" if t.layers else "layers (pipeline_layers)")
                          + "; plan it without checkpointing")
    sync = grad_sync_cost(lay.strategy)
    stages = schedule_cost.stages(t, lay, micro, optim, sync)
    t_rank = max(stages, key=lambda st: st["model_state_bytes"])["trace"]  # the rank with the most model state
    # every model-sharding component the layout turns on prices itself (the same components that train)
    prices = [kind.price(t, t_rank, lay, micro, optim) for kind in components.wanted(lay.strategy)]
    narrow = 0.5 if lay.strategy.precision != "fp32" else 1.0  # autocast saves its products' inputs in 2 bytes
    out = {"layout": _layout_record(lay), "link": {"name": link.name, "bandwidth_Bps": link.bandwidth,
                                                    "latency_s": link.latency, "burst_bytes": link.burst},
           **memory(t, lay, sync, stages, prices, micro, optim, narrow)}
    out.update(schedule_cost.report(lay, stages))
    if lay.group > 1:  # GRPO: the rollout before the update (:mod:`distlab.plan.rollout`)
        r = out["rollout"] = rollout.price(t, lay)
        r["peak_bytes_per_rank"] = out["model_state_bytes_per_rank"] + r["memory_bytes_per_rank"]
        out["memory_bytes_per_rank"] = max(out["memory_bytes_per_rank"], r["peak_bytes_per_rank"])
    for price in prices:
        out.update(price.report)
    out.update(comm_bytes(t, lay, sync, stages, micro, optim))
    if cluster is not None:
        out.update(cluster.facts(lay))
    if lay.offload != "none":  # what --offload holds off the device and moves (:mod:`distlab.plan.offload`)
        out["offload"] = offload.held(t_rank, lay, sync, optim, lambda o: state_parts(t_rank, lay, sync, o))
    machine = cluster if cluster is not None else CalibratedHost(cal, link) if cal is not None else None
    if machine is not None:
        out.update(step_time(t, lay, machine, sync, stages, prices, micro, narrow, dense_trace(t_rank, lay)))
        if cluster is not None and lay.offload != "none":
            offload.timed(out, t, lay, cluster)
        if cluster is not None and lay.group > 1:
            out["rollout"].update(rollout.timed(out["rollout"], t, lay, cluster, out["step_s"]))
    return out


def _layout_record(lay: Layout) -> dict:
    hybrid = {"dp_shard": lay.zero_shard} if lay.zero and lay.zero_shard < lay.replicas else {}
    return {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero, **hybrid,
            "dp_sync": lay.dp_sync, "collective": lay.collective, "global_batch_size": lay.global_batch,
            "grad_accum": lay.grad_accum, "microbatches": lay.strategy.microbatches,
            "pp_schedule": lay.strategy.pp_schedule if lay.pp > 1 else None,
            "sequence_parallel": lay.strategy.sequence_parallel, "optimizer": lay.optimizer, "world_size": lay.world,
            **({"offload": lay.offload} if lay.offload != "none" else {}),
            **({"offload_overlap": True} if lay.offload_overlap else {}),
            **({"optimizer_state": lay.optimizer_state} if lay.optimizer_state != "fp32" else {})}


def memory(t: Trace, lay: Layout, sync, stages: list[dict], prices: list, micro: int, optim, narrow: float) -> dict:
    """What a rank holds: the model state's peak (the stage holding the most; each component's savings taken
    off), its textbook parts, activations (halved under autocast), the loss's, the load's peak, compression state
    and recomputation -- and the sum, ``memory_bytes_per_rank``."""
    heaviest = max(stages, key=lambda st: st["model_state_bytes"])
    t_rank = heaviest["trace"]
    # (ZeRO-3's gathers are replayed one micro-batch after another, not in a pipeline schedule's order: there the
    # peak is an estimate -- 13% under the measured one on a 2-stage 1F1B GPT; so is ZeRO-2's on a pipeline of
    # a mixture of experts, which the replay does not yet follow -- 11% under the measured one on a 2-stage GPT-MoE)
    estimate = lay.pp > 1 and (lay.zero == 3 or (lay.zero == 2 and bool(t.expert_names)))
    state, exact = heaviest["model_state_bytes"], all(p.exact for p in prices) and not estimate
    parts = state_parts(t_rank, lay, sync, optim)
    for price in prices:
        for what, nbytes in price.saved.items():
            parts[what] -= nbytes
            state -= nbytes
    out = {"num_parameters": t.num_parameters,
           **({"trained_parameters": sum(n for u, n in enumerate(t.numels) if t.trains(u))} if t.trainable else {}),
           "model_state_bytes_per_rank": int(state), "model_state_exact": exact,
           "model_state_basis": "peak of parameters + gradients + optimizer state, with ZeRO's transient buffers"
                                + (" (the pipeline stage holding the most)" if lay.pp > 1 else ""),
           **parts, "activation_basis": _activation_basis(lay, prices)}
    extra = sum(p.activation_extra for p in prices)  # what a component saves beyond the layers' split share
    for st in stages:
        st["activation_bytes"] += int(extra * st["micro_batches_held"])
    out["activation_bytes_float32_per_rank"] = int(max(st["activation_bytes"] for st in stages))  # (a meta-device
    out["activation_bytes_per_rank"] = int(out["activation_bytes_float32_per_rank"] * narrow)  # dry run's)
    if narrow != 1.0:
        out["activation_basis"] += f"; halved under {lay.strategy.precision} autocast (products save 2-byte inputs)"
    out["load_peak_bytes_per_rank"] = load_peak(t, parts, lay.strategy)
    out["compression_state_bytes_per_rank"] = sync.planned_extra_state(t_rank, lay.strategy, lay.replicas)
    loss = loss_bytes(t, lay, micro, narrow)
    if loss:
        out["loss_bytes_per_rank"] = int(loss)
    out["memory_bytes_per_rank"] = int(max(st["model_state_bytes"] + narrow * (st["activation_bytes"] + st["recompute_bytes"])
                                           + (loss if st is stages[-1] else 0.0)
                                           for st in stages) + out["compression_state_bytes_per_rank"])
    if lay.strategy.activation_checkpointing:
        out["activation_checkpointing"] = {
            "blocks": len(lay.strategy.checkpointed(t.blocks)),
            "recompute_bytes_per_rank": int(narrow * max(st["recompute_bytes"] for st in stages)),
            "recompute_flops_share": max(st["recompute_flops_share"] for st in stages),
            "basis": "each block's input kept for backward (in activation_bytes_per_rank); in backward one block at a "
                     "time recomputes its inside for one micro-batch (recompute_bytes_per_rank, in "
                     "memory_bytes_per_rank), a second forward of the blocks' layers (in the step time)"}
    return out


def _activation_basis(lay: Layout, prices: list) -> str:
    basis = "tensors autograd saves for backward, each storage once, one micro-batch"
    if lay.strategy.activation_checkpointing:
        basis += ", of checkpointed blocks only their inputs"
    return basis + "".join(p.activation_note for p in prices) + schedule_cost.activation_note(lay)


# ---------------------------------------------------------------------------------- sweep

def sweep(t: Trace, base: Layout, worlds: list[int], link: Link, cal: Calibration | None,
          device_memory: int | None, strategies: list[Strategy]) -> list[dict]:
    """Predictions for each strategy at each data-parallel world size (the global batch grows with
    it: weak scaling), with whether it fits in ``device_memory``."""
    rows = []
    per_rank = base.global_batch // base.dp
    for strategy in strategies:
        for n in worlds:
            lay = replace(base, dp=n, global_batch=per_rank * n, strategy=strategy)
            p = predict(t, lay, link, cal)
            p["fits"] = device_memory is None or p["memory_bytes_per_rank"] <= device_memory
            p["device_memory_bytes"] = device_memory
            p["strategy"] = strategy.to_dict()
            p["strategy_text"] = str(strategy)
            rows.append(p)
    return rows
