"""``distlab plan``: a layout's memory per rank and time per step, and sweeps over world sizes.

:func:`predict` turns a model :class:`~distlab.parallel.cost.Trace`, a :class:`Layout` and a
:class:`~distlab.plan.machine.Link` into memory per rank (exact for DP and ZeRO) and, with a
:class:`~distlab.plan.calibration.Calibration`, time per step; :func:`sweep` walks world sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from distlab.errors import ConfigError
from distlab.parallel import Strategy
from distlab.parallel import components
from distlab.parallel.cost import Call, DataParallelCost, Optim
from distlab.plan.trace import Trace, stage_trace
from distlab.parallel.pipeline import cut, ideal_bubble
from distlab.parallel.zero.cost import ZeroCost
from distlab.plan.calibration import Calibration
from distlab.plan.machine import Link, rounds, volume


@dataclass(frozen=True)
class Layout:
    """What to predict for: data-parallel size, the strategy (tp, ZeRO, sync method ...), batch, optimizer."""
    dp: int = 1
    strategy: Strategy = Strategy()
    optimizer: str = "sgd"
    momentum: float = 0.9
    global_batch: int = 64
    threads: int | None = None
    oversubscription: float = 1.0  # ranks x threads per core on the busiest host: compute runs this much slower

    def check(self) -> "Layout":
        if self.dp < 1:
            raise ConfigError(f"`dp` {self.dp} must be at least 1")
        self.strategy.check(self.world)
        self.strategy.check_batch(self.global_batch, self.world)
        return self

    @property
    def world(self) -> int:
        return self.dp * self.strategy.tp * self.strategy.pp * self.strategy.cp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same part of the model: data x context parallel."""
        return self.dp * self.strategy.cp

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
    (each says what it sends, ``planned_calls``, and holds, ``planned_memory``)."""
    return ZeroCost if strategy.zero else DataParallelCost


class Timer:
    def __init__(self, cal: Calibration, link: Link, n: int, same_host: bool = False):
        self.cal, self.link, self.n = cal, link, n
        self.world = n if same_host else None  # use the fit measured at this world size (shared cores)
        self.link_free = 0.0  # when the link last went idle (for the token bucket)

    def duration(self, call: Call, start: float) -> float:
        if self.n <= 1:
            return 0.0
        ab = self.cal.alpha_beta(call.algorithm, self.world)
        r, v = rounds(call.algorithm, self.n, call.kind), volume(call.algorithm, self.n, call.nbytes, call.kind)
        host = ab.alpha * r + ab.beta * v
        if self.link.bandwidth is None:
            return host
        rate = self.link.bandwidth * self.link.efficiency
        idle = max(0.0, start - self.link_free)
        if call.algorithm == "gather_scatter":  # rank 0's two phases: each direction idled during the other
            phase = v / 2
            wire = 2 * max(0.0, phase - min(self.link.burst, self.link.bandwidth * (phase / rate + idle))) / rate
        else:
            wire = max(0.0, v - min(self.link.burst, self.link.bandwidth * idle)) / rate
        return host + r * self.link.latency + wire


def predict(t: Trace, lay: Layout, link: Link, cal: Calibration | None) -> dict:
    """Memory per rank and (with a calibration) time per step of ``lay`` over ``link``."""
    lay.check()
    micro = lay.global_batch // lay.dp // lay.strategy.micro_steps
    optim = Optim.of(lay.optimizer, lay.momentum)
    if lay.strategy.activation_checkpointing and not (t.blocks and t.layers):
        raise ConfigError("`activation_checkpointing`: plan counts what each layer keeps, and this model lists no "
                          + ("blocks (checkpoint_blocks)" if t.layers else "layers (pipeline_layers)")
                          + "; plan it without checkpointing")
    stages = _stages(t, lay, micro, optim)
    heaviest = max(stages, key=lambda st: st["model_state_bytes"])
    t_rank = heaviest["trace"]  # what the rank with the most model state holds
    # every model-sharding component the layout turns on prices itself (the same components that train)
    prices = [kind.price(t, t_rank, lay, micro, optim) for kind in components.kinds()
              if components.wanted(kind, lay.strategy) and getattr(kind, "price", None) is not None]
    split, compute_split = math.prod(p.state_split for p in prices), math.prod(p.compute_split for p in prices)
    state, exact = heaviest["model_state_bytes"], all(p.exact for p in prices)
    e, n = t.element_size, lay.replicas
    shards = [math.ceil(m / split / n) for m in t_rank.numels]
    full = [math.ceil(m / split) for m in t_rank.numels]
    parts = {  # the textbook split (ZeRO paper, table 1): what each kind comes to between steps
        "parameter_bytes_per_rank": e * sum(shards if lay.zero == 3 else full),
        "gradient_bytes_per_rank": e * sum(shards if lay.zero >= 2 else full),
        "optimizer_bytes_per_rank": sum(optim.bytes(m, e) for m in (shards if lay.zero >= 1 else full)),
    }
    for price in prices:
        for what, nbytes in price.saved.items():
            parts[what] -= nbytes
            state -= nbytes
    out = {"layout": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero, "dp_sync": lay.dp_sync,
                      "collective": lay.collective, "global_batch_size": lay.global_batch,
                      "grad_accum": lay.grad_accum, "microbatches": lay.strategy.microbatches,
                      "pp_schedule": lay.strategy.pp_schedule if lay.pp > 1 else None,
                      "sequence_parallel": lay.strategy.sequence_parallel,
                      "optimizer": lay.optimizer, "world_size": lay.world},
           "link": {"name": link.name, "bandwidth_Bps": link.bandwidth, "latency_s": link.latency,
                    "burst_bytes": link.burst},
           "num_parameters": t.num_parameters,
           "model_state_bytes_per_rank": int(state), "model_state_exact": exact,
           "model_state_basis": "peak of parameters + gradients + optimizer state, with ZeRO's transient buffers"
                                + (" (the pipeline stage holding the most)" if lay.pp > 1 else ""),
           **parts,
           "activation_bytes_per_rank": int(max(st["activation_bytes"] for st in stages)),
           "activation_basis": _activation_basis(lay, prices)}
    narrow = 0.5 if lay.strategy.precision != "fp32" else 1.0  # autocast saves its products' inputs in 2 bytes
    if narrow != 1.0:
        out["activation_bytes_per_rank"] = int(out["activation_bytes_per_rank"] * narrow)
        out["activation_basis"] += f"; halved under {lay.strategy.precision} autocast (products save 2-byte inputs)"
    sync = grad_sync_cost(lay.strategy)
    out["compression_state_bytes_per_rank"] = sync.planned_extra_state(t_rank, lay.strategy, lay.replicas)
    out["memory_bytes_per_rank"] = int(max(st["model_state_bytes"] + narrow * (st["activation_bytes"] + st["recompute_bytes"])
                                           for st in stages) + out["compression_state_bytes_per_rank"])
    if lay.strategy.activation_checkpointing:
        out["activation_checkpointing"] = {
            "blocks": len(t.blocks), "recompute_bytes_per_rank": int(narrow * max(st["recompute_bytes"] for st in stages)),
            "recompute_flops_share": max(st["recompute_flops_share"] for st in stages),
            "basis": "each block's input kept for backward (in activation_bytes_per_rank); in backward one block at a "
                     "time recomputes its inside for one micro-batch (recompute_bytes_per_rank, in "
                     "memory_bytes_per_rank), a second forward of the blocks' layers (in the step time)"}
    if lay.pp > 1:
        out["pipeline"] = {
            "stages": [{k: v for k, v in st.items() if k != "trace"} for st in stages],
            "microbatches": lay.strategy.microbatches, "schedule": lay.strategy.pp_schedule,
            "virtual": lay.strategy.pp_virtual,
            "bubble_ideal": ideal_bubble(lay.pp, lay.strategy.microbatches, lay.strategy.pp_schedule,
                                         lay.strategy.pp_virtual),
            "p2p_bytes_per_step_per_rank": max(st["sent_bytes_per_step"] for st in stages)}
    for price in prices:
        out.update(price.report)
    if cal is None:
        return out
    comp = cal.compute_for(lay.threads)
    if lay.oversubscription > 1:
        comp = replace(comp, rate=comp.rate / lay.oversubscription, overhead=comp.overhead * lay.oversubscription)
    pace = max(stages, key=lambda st: st["flops_share"] * t.flops_per_sample
               + st["recompute_flops_share"] * t.forward_flops_per_sample)  # the slowest stage sets the pace
    share = pace["flops_share"]
    flops = (t.flops_per_sample * share + t.forward_flops_per_sample * pace["recompute_flops_share"]) * micro \
        * lay.strategy.micro_steps / compute_split  # checkpointing's recomputation runs in backward
    fwd = t.forward_flops_per_sample * share * micro * lay.strategy.micro_steps / compute_split / comp.rate
    bwd = flops / comp.rate - fwd
    # fill and drain: every stage idles P - 1 micro-batch slots of the step, M / (M + P - 1) busy
    stretch = 1.0 / (1.0 - ideal_bubble(lay.pp, lay.strategy.microbatches, lay.strategy.pp_schedule,
                                         lay.strategy.pp_virtual))
    fwd, bwd = fwd * stretch, bwd * stretch
    calls = sync.planned_calls(t_rank, lay.strategy, lay.replicas)
    overlapped, after, after_step = calls.during_backward, calls.after_backward, calls.after_step
    timer = Timer(cal, link, lay.replicas, same_host=lay.oversubscription > 1)
    exposed_pre = sum(timer.duration(c, 0.0) for c in calls.before_layers)  # ZeRO-3's gathers: the layer waits
    tp_time = 0.0  # the components' collectives, on the critical path (a local group shares a node's fast links)
    for price in prices:
        for group in price.calls:
            timer_g = Timer(cal, Link() if group.local else link, group.ranks)
            tp_time += share * sum(timer_g.duration(c, 0.0) for c in group.calls)
    if lay.pp > 1:  # a stage's sends and receives, one message each per micro-batch and direction
        p2p_timer = Timer(cal, link, 2)
        boundary = max(st["boundary_bytes_per_microbatch"] for st in stages)
        tp_time += 2 * lay.strategy.microbatches * p2p_timer.duration(Call("native", "all_gather", 2 * boundary), 0.0)
    comm_total = exposed_pre + tp_time
    start_bwd = fwd + exposed_pre / 2
    end_bwd = start_bwd + bwd + exposed_pre / 2
    free = 0.0
    timer.link_free = -comp.overhead  # the optimizer step of the previous step left the link idle
    for c in sorted(overlapped, key=lambda c: c.ready):
        s = max(start_bwd + c.ready * bwd, free)
        d = timer.duration(c, s)
        free, timer.link_free, comm_total = s + d, s + d, comm_total + d
    cur = max(end_bwd, free)
    for c in after:
        d = timer.duration(c, cur)
        cur, timer.link_free, comm_total = cur + d, cur + d, comm_total + d
    cur += comp.overhead
    for c in after_step:
        d = timer.duration(c, cur)
        cur, timer.link_free, comm_total = cur + d, cur + d, comm_total + d
    step = cur + tp_time
    compute = comp.time(flops) * stretch
    per_rank = f"{comp.threads} thread{'s' if comp.threads != 1 else ''} per rank"
    out.update({"compute_basis": (f"calibrated at {per_rank}" if comp.scaled_from is None else
                                  f"not calibrated at {per_rank}: the rate measured at "
                                  f"{comp.scaled_from} scaled by {comp.threads}/{comp.scaled_from}"),
                "oversubscription": lay.oversubscription, "compute_s": compute, "comm_s": comm_total, "exposed_comm_s": step - compute, "step_s": step,
                "samples_per_s": lay.global_batch / step, "threads_per_rank": comp.threads,
                "scaling_efficiency": compute / step if step else None})
    return out


def _activation_basis(lay: Layout, prices: list) -> str:
    basis = "tensors autograd saves for backward, one micro-batch (an upper bound)"
    if lay.strategy.activation_checkpointing:
        basis += ", of checkpointed blocks only their inputs"
    basis += "".join(p.activation_note for p in prices)
    if lay.pp > 1:
        v = lay.strategy.pp_virtual
        basis += (f"; a pipeline stage holds {lay.strategy.microbatches} micro-batches (gpipe)"
                  if lay.strategy.pp_schedule == "gpipe" else
                  f"; rank s holds min(V M, 2 (P - s - 1) + (V - 1) P + 1) chunk-micro-batches of its {v} chunks "
                  f"(interleaved)" if v > 1 else
                  f"; stage s holds min(M, P - s) micro-batches ({lay.strategy.pp_schedule}"
                  + (": a graph kept until its weight pass" if lay.strategy.pp_schedule == "zb" else "") + ")")
    return basis


def _runs(t: Trace, a: int, b: int) -> list[tuple[list[int], bool]]:
    """Layers ``a..b-1`` as consecutive runs ``(indices, checkpointed)``: each part of one
    activation-checkpointing block a run (as a pipeline stage recomputes them), other layers alone."""
    block_of = {name: k for k, names in enumerate(t.blocks) for name in names}
    runs: list[tuple[list[int], int | None]] = []
    for i in range(a, b):
        k = block_of.get(t.layers[i].name)
        if runs and k is not None and runs[-1][1] == k:
            runs[-1][0].append(i)
        else:
            runs.append(([i], k))
    return [(run, k is not None) for run, k in runs]


def _stages(t: Trace, lay: Layout, micro: int, optim: Optim) -> list[dict]:
    """Per pipeline stage (one stage: the whole model): its trace, model state, activations held,
    share of the FLOPs and bytes it sends per micro-batch. Cut as the training run cuts
    (:func:`distlab.parallel.pipeline.cut`, by parameters or ``pp_balance``)."""
    if lay.pp > 1 and not t.layers:
        raise ConfigError("`pp`: this model is not a sequence of layers a pipeline can cut; plan it with `pp` 1")
    layers = t.layers or []
    v = lay.strategy.pp_virtual if lay.pp > 1 else 1
    cuts = cut([layer.parameters for layer in layers], lay.pp * v, lay.strategy.pp_balance) if lay.pp > 1 else \
        [(0, len(layers))]
    total_flops = sum(layer.forward_flops for layer in layers) or 1.0
    sp, out, m_total = lay.strategy.sequence_parallel, [], lay.strategy.microbatches
    for s in range(lay.pp):
        chunks = [cuts[c * lay.pp + s] for c in range(v)]  # rank s holds virtual stages s, s + P, ...
        mine = [layer for a, b in chunks for layer in layers[a:b]]
        sub = stage_trace(t, [layer.name for layer in mine]) if lay.pp > 1 else t
        if lay.tp > 1:
            sub = replace(sub, numels=[math.ceil(m / lay.tp) for m in sub.numels])
        state = grad_sync_cost(lay.strategy).planned_memory(sub, optim, lay.strategy, lay.replicas)
        recompute = recompute_flops = 0.0
        if mine and lay.strategy.activation_checkpointing:
            saved = replicated = 0.0
            for a, b in chunks:
                for run, checkpointed in _runs(t, a, b):
                    if checkpointed:  # the block's input kept (replicated over TP unless sequence parallel)
                        kept = layers[run[0] - 1].output_bytes if run[0] else t.input_bytes_per_sample
                        saved, replicated = saved + kept, replicated + (0.0 if sp else kept)
                        inside = sum(layers[i].saved_bytes for i in run)  # while recomputed, one at a time
                        rep = 0.0 if sp else sum(layers[i].replicated_saved_bytes for i in run)
                        recompute = max(recompute, ((inside - rep) / lay.tp + rep) / lay.cp * micro)
                        recompute_flops += sum(layers[i].forward_flops for i in run)
                    else:
                        saved += sum(layers[i].saved_bytes for i in run)
                        replicated += 0.0 if sp else sum(layers[i].replicated_saved_bytes for i in run)
        elif mine:
            saved = sum(layer.saved_bytes for layer in mine)
            replicated = 0.0 if sp else sum(layer.replicated_saved_bytes for layer in mine)
        else:  # a model without a layer profile: the whole-model estimate
            saved, replicated = t.activation_bytes_per_sample, 0.0
        per_sample = ((saved - replicated) / lay.tp + replicated) / lay.cp
        if lay.pp == 1:
            held = 1.0
        elif lay.strategy.pp_schedule == "gpipe":
            held = m_total
        elif v > 1:  # Megatron's warm-up chunks in flight, each a V-th of the rank's layers
            held = min(m_total * v, (lay.pp - s - 1) * 2 + (v - 1) * lay.pp + 1) / v
        else:
            held = min(m_total, lay.pp - s)
        boundary = before = 0.0
        for k, (a, b) in ((c * lay.pp + s, chunks[c]) for c in range(v)):
            if k < len(cuts) - 1 and b > a:
                boundary += layers[b - 1].output_bytes * micro / (lay.tp if sp else 1)
            if a > 0:
                before += layers[a - 1].output_bytes * micro / (lay.tp if sp else 1)
        out.append({"stage": s, "layers": [chunks[0][0], chunks[-1][1]], "first": mine[0].name if mine else None,
                    "last": mine[-1].name if mine else None, "parameters": sum(sub.numels),
                    **({"chunks": [list(c) for c in chunks]} if v > 1 else {}),
                    "model_state_bytes": int(state), "activation_bytes": int(per_sample * micro * held),
                    "flops_share": sum(layer.forward_flops for layer in mine) / total_flops if lay.pp > 1 else 1.0,
                    "recompute_flops_share": recompute_flops / total_flops, "recompute_bytes": int(recompute),
                    "boundary_bytes_per_microbatch": int(boundary),
                    "sent_bytes_per_step": int((boundary + before) * m_total),
                    "trace": sub})
    return out


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
