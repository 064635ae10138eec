"""What times a planned step: a :class:`Machine` -- its compute, its links, the timer of a collective -- and the
step's timeline priced on it (:func:`step_time`). Two machines implement it: this CPU host as a calibration
measured it (:class:`CalibratedHost`: alpha-beta fits of each collective, a FLOP rate per thread count, over the
run's link) and a GPU cluster (:class:`~distlab.plan.gpu.Cluster`: a datasheet's peak at a measured efficiency,
NCCL over NVLink and the network). :func:`~distlab.plan.predict.predict` asks the protocol only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from distlab.parallel import components
from distlab.parallel.cost import Call
from distlab.parallel.pipeline import cost as schedule_cost
from distlab.parallel.pipeline import ideal_bubble
from distlab.plan.calibration import Calibration
from distlab.plan.machine import Compute, Link, rounds, volume


class Machine(Protocol):
    """Where a planned step runs: what it computes at, what times its collectives, and what it says about both."""

    overlaps_gathers: bool  # ZeRO-3's next gather runs while a layer computes (a GPU's streams)

    def compute(self, lay, trained_elements: int) -> Compute:
        """The rate forward and backward run at and the optimizer step's time (``trained_elements``: what the
        rank's optimizer steps)."""

    def sync_timer(self, lay):
        """The timer of the gradient sync's collectives (``duration(call, start)``, ``link_free``)."""

    def group_timer(self, lay, group, narrow: float):
        """The timer of a component's group of collectives (``narrow``: an activation's bytes under autocast)."""

    def flop_factor(self, t) -> float:
        """The FLOPs a rate was measured against, per FLOP of the trace's count."""

    def basis(self, lay, comp: Compute) -> str:
        """Where the compute rate comes from, in words."""

    def rates(self, t, lay, step: float) -> dict:
        """What the machine reports per device at a step of ``step`` seconds (tokens/s per GPU, MFU), or {}."""


class SyncTimer:
    """The time of a planned collective on this host (a calibration's alpha-beta fit of its algorithm) over
    ``link`` (its bandwidth, latency and token bucket), between ``n`` ranks."""

    def __init__(self, cal: Calibration, link: Link, n: int, same_host: bool = False):
        self.cal, self.link, self.n = cal, link, n
        self.world = n if same_host else None  # use the fit measured at this world size (shared cores)
        self.link_free = 0.0  # when the link last went idle (for the token bucket)
        self.separate_spans = False  # one link for every call (hybrid sharding's groups share it)

    def duration(self, call: Call, start: float) -> float:
        n = call.ranks or self.n  # (hybrid sharding's calls span part of the group)
        if n <= 1:
            return 0.0
        ab = self.cal.alpha_beta(call.algorithm, self.world)
        r, v = rounds(call.algorithm, n, call.kind), volume(call.algorithm, n, call.nbytes, call.kind)
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


@dataclass
class CalibratedHost:
    """This CPU host, as ``distlab plan calibrate`` measured it, over ``link``."""

    cal: Calibration
    link: Link
    overlaps_gathers = False

    def compute(self, lay, trained_elements: int) -> Compute:
        return self.cal.compute_for(lay.threads)

    def sync_timer(self, lay) -> SyncTimer:
        return SyncTimer(self.cal, self.link, lay.replicas, same_host=lay.oversubscription > 1)

    def group_timer(self, lay, group, narrow: float) -> SyncTimer:
        return SyncTimer(self.cal, Link() if group.local else self.link, group.ranks)

    def flop_factor(self, t) -> float:
        return 1.0

    def basis(self, lay, comp: Compute) -> str:
        per_rank = f"{comp.threads} thread{'s' if comp.threads != 1 else ''} per rank"
        return (f"calibrated at {per_rank}" if comp.scaled_from is None else
                f"not calibrated at {per_rank}: the rate measured at {comp.scaled_from} scaled by "
                f"{comp.threads}/{comp.scaled_from}")

    def rates(self, t, lay, step: float) -> dict:
        return {}


def step_time(t, lay, machine: Machine, sync, stages: list[dict], prices: list, micro: int, narrow: float,
              dense) -> dict:
    """A step of ``lay`` on ``machine``: forward and backward at its rate (the slowest stage's share, stretched
    by the pipeline's bubble), ZeRO-3's gathers before the layers, the gradient sync's collectives where they
    run (during backward, after it, after the optimizer step), the components' and the pipeline's on the
    critical path -- and the step's timeline. ``dense``: what the gradient sync reduces of the rank's trace."""
    t_rank = max(stages, key=lambda st: st["model_state_bytes"])["trace"]
    trained = sum(n for u, n in enumerate(t_rank.numels) if t_rank.trains(u))  # what its optimizer steps (ZeRO:
    comp = machine.compute(lay, trained // (lay.zero_shard if lay.zero else 1))  # its shard)
    if lay.oversubscription > 1:
        comp = replace(comp, rate=comp.rate / lay.oversubscription, overhead=comp.overhead * lay.oversubscription)
    fwd, bwd, flops, stretch = _compute_split(t, lay, machine, stages, prices, micro, comp)
    calls = sync.planned_calls(dense, lay.strategy, lay.replicas)
    timer = machine.sync_timer(lay)
    gathers = [timer.duration(c, 0.0) for c in calls.before_layers]  # ZeRO-3's gathers: the layer waits
    exposed_pre = sum(gathers)
    if machine.overlaps_gathers and gathers:  # the next layer's gather runs while this one computes
        exposed_pre = max(max(gathers), exposed_pre - fwd - bwd)
    hidden_pre = sum(gathers) - exposed_pre  # (what ran beside the compute: counted in the communication)
    tp_time, component_comm = _component_time(t, lay, machine, prices, stages, narrow, comp)
    comm_total = exposed_pre + hidden_pre + sum(c["seconds"] - c["exposed_s"] for c in component_comm.values())
    comm_total += tp_time
    step, comm_total, spans = _timeline(lay, fwd, bwd, stretch, exposed_pre, calls, timer, comp, tp_time, stages,
                                        comm_total)
    compute = comp.time(flops) * stretch
    return {"compute_basis": machine.basis(lay, comp),
            "oversubscription": lay.oversubscription, "compute_s": compute, "comm_s": comm_total,
            "exposed_comm_s": step - compute, "step_s": step, "component_comm": component_comm,
            "first_forward_s": fwd / stretch / lay.strategy.micro_steps,  # (a step's first micro-batch's forward)
            "samples_per_s": lay.global_batch / step, "threads_per_rank": comp.threads,
            **machine.rates(t, lay, step),
            "scaling_efficiency": compute / step if step else None,
            "timeline": [{"rank": r, "name": n, "lane": lane, "start_s": a, "end_s": b}
                         for r, n, lane, a, b in spans if b > a]}


def _compute_split(t, lay, machine: Machine, stages: list[dict], prices: list, micro: int, comp: Compute):
    """(forward seconds, backward seconds, the step's FLOPs, the bubble's stretch) of the slowest stage."""
    import math
    compute_split = math.prod(p.compute_split for p in prices)
    pace = max(stages, key=lambda st: st["flops_share"] * t.flops_per_sample
               + st["recompute_flops_share"] * t.forward_flops_per_sample)  # the slowest stage sets the pace
    share, counted = pace["flops_share"], machine.flop_factor(t)
    flops = counted * (t.flops_per_sample * share + t.forward_flops_per_sample * pace["recompute_flops_share"]) \
        * micro * lay.strategy.micro_steps / compute_split  # checkpointing's recomputation runs in backward
    fwd = counted * t.forward_flops_per_sample * share * micro * lay.strategy.micro_steps / compute_split / comp.rate
    bwd = flops / comp.rate - fwd
    # fill and drain: every stage idles P - 1 micro-batch slots of the step, M / (M + P - 1) busy
    stretch = 1.0 / (1.0 - ideal_bubble(lay.pp, lay.strategy.microbatches, lay.strategy.pp_schedule,
                                         lay.strategy.pp_virtual))
    return fwd * stretch, bwd * stretch, flops, stretch


def _component_time(t, lay, machine: Machine, prices: list, stages: list[dict], narrow: float, comp: Compute):
    """The components' collectives on the critical path (each priced on the stage's own part; a local group
    shares a node's fast links) and the pipeline stage's messages (whole, not a stage's share)."""
    tp_time, component_comm = 0.0, {}
    seconds_per_flop = machine.flop_factor(t) / comp.rate
    for kind, price in zip(components.wanted(lay.strategy), prices):
        seconds = [_group_seconds(g, machine.group_timer(lay, g, narrow), seconds_per_flop) for g in price.calls]
        component_comm[kind.name] = {"seconds": sum(a for a, _ in seconds), "exposed_s": sum(b for _, b in seconds)}
        tp_time += component_comm[kind.name]["exposed_s"]
    for group in schedule_cost.calls(lay, stages):
        tp_time += sum(machine.group_timer(lay, group, narrow).duration(c, 0.0) for c in group.calls)
    return tp_time, component_comm


def _timeline(lay, fwd, bwd, stretch, exposed_pre, calls, timer, comp, tp_time, stages, comm_total):
    """(the step's seconds, the communication's, the predicted timeline's spans): the same lanes as a measured
    trace (runtime.timeline); a pipeline's stages each play the schedule (their forwards and backwards per
    micro-batch, their waits)."""
    start_bwd = fwd + exposed_pre / 2
    end_bwd = start_bwd + bwd + exposed_pre / 2
    if lay.pp > 1:
        staged = schedule_cost.timeline(lay, fwd / stretch, bwd / stretch)
    else:
        staged = [(0, "forward", "compute", 0.0, fwd), (0, "backward", "compute", start_bwd, start_bwd + bwd)]
    spans = []
    if exposed_pre:  # ZeRO-3's gathers before the layers: half in forward, half in backward, waited for
        spans += [("all-gather (forward)", "communication", fwd, start_bwd),
                  ("all-gather (backward)", "communication", start_bwd + bwd, end_bwd)]
    free = 0.0
    timer.link_free = -comp.overhead  # the optimizer step of the previous step left the link idle
    across, done = 0.0, 0.0  # hybrid sharding: its own group's link, from the end of the reduce-scatter before
    for c in sorted(calls.during_backward, key=lambda c: c.ready):  # (stable: each shard's all-reduce after it)
        if c.span == "replicate" and timer.separate_spans:
            s = max(done, across)
            d = timer.duration(c, s)
            across, comm_total = s + d, comm_total + d
        else:
            s = max(start_bwd + c.ready * bwd, free)
            d = timer.duration(c, s)
            free, done, timer.link_free, comm_total = s + d, s + d, s + d, comm_total + d
        spans.append((_call_name(c), "communication", s, s + d))
    cur = max(end_bwd, free, across)
    for c in calls.after_backward:
        d = timer.duration(c, cur)
        spans.append((_call_name(c), "communication", cur, cur + d))
        cur, timer.link_free, comm_total = cur + d, cur + d, comm_total + d
    spans.append(("optimizer step", "compute", cur, cur + comp.overhead))
    cur += comp.overhead
    for c in calls.after_step:
        d = timer.duration(c, cur)
        spans.append((_call_name(c), "communication", cur, cur + d))
        cur, timer.link_free, comm_total = cur + d, cur + d, comm_total + d
    step = cur + tp_time
    if tp_time:  # the components' and the pipeline's collectives, on the critical path, as one block
        spans.append(("tensor/context/expert/pipeline collectives", "communication", cur, step))
    # what follows the forwards and backwards runs on every stage alike
    return step, comm_total, staged + [(s, *span) for s in range(lay.pp) for span in spans]


def _group_seconds(group, timer, seconds_per_flop: float) -> tuple[float, float]:
    """(the group's collectives' time, what of it the compute beside each hop does not hide)."""
    hop = sum(timer.duration(c, 0.0) for c in group.calls)
    return group.hops * hop, group.hops * max(0.0, hop - group.hidden_flops * seconds_per_flop)


def _call_name(c: Call) -> str:
    """A predicted collective's span name: ``all-reduce 1.9 MB``."""
    from distlab.runtime.timeline import size_text
    return f"{c.kind.replace('_', '-')} {size_text(int(c.nbytes))}"
